"""Every flag is read, refused, or named as unused: the table of settings a mode does not read,
walked option by option, and the cases a user meets, through ``resolve``."""

from __future__ import annotations

import pytest

from fasttrain.config import OPTION_BY_KEY, Config
from fasttrain.config.parse import Parsed
from fasttrain.errors import UserError
from fasttrain.run.moot import ALWAYS_READ, MOOT, Launch, given_keys, moot_notes
from tests.config.test_config import resolved


def _resolved(cfg: Config) -> Config:
    """``cfg`` with the values ``resolve`` fills in, and parsed."""
    cfg.train.triton_kernels = "none"
    cfg.train.compile_mode = "default"
    cfg.parsed = Parsed.of(cfg)
    return cfg


def _modes() -> list[tuple[Config, Launch]]:
    """Configs as ``resolve`` leaves them, one per mode a setting can be moot in."""
    out = []
    for loader, device, schedule, test_only in [
        ("synthetic", "cuda", "cosine", False),
        ("dali", "cpu", "step", False),
        ("dali", "cuda", "poly", False),
        ("torchvision", "cuda", "step", True),
    ]:
        cfg = Config()
        cfg.data.loader, cfg.train.device, cfg.optim.lr_schedule = loader, device, schedule
        cfg.train.strategy, cfg.run.test_only = "none", test_only
        out.append((_resolved(cfg), Launch(1)))
    for world, strategy, batch, inductor in [
        (2, "ddp", 256, "none"),
        (1, "none", None, "coordinate_descent_tuning"),
    ]:  # compiled
        cfg = Config()
        cfg.data.loader, cfg.train.device, cfg.train.compile = "synthetic", "cuda", True
        cfg.train.strategy, cfg.train.batch_size = strategy, batch
        cfg.train.inductor_options = inductor
        out.append((_resolved(cfg), Launch(world)))
    return out


def test_every_option_is_read_in_every_mode_or_listed_where_it_is_not():
    """A flag added later must be classified here, or this fails: never silently dropped."""
    listed = {k for moot in MOOT for k in moot.keys}
    assert set(OPTION_BY_KEY) == ALWAYS_READ | listed, set(OPTION_BY_KEY) ^ (ALWAYS_READ | listed)
    assert not ALWAYS_READ & listed


@pytest.mark.parametrize("moot", MOOT, ids=[m.keys[0] for m in MOOT])
def test_each_setting_is_named_in_each_mode_that_does_not_read_it(moot):
    """Every key of every entry, given in a mode where the entry applies, is named with the
    entry's reason; in a mode where it does not apply, that reason is not given."""
    applied = 0
    for cfg, launch in _modes():
        for key in moot.keys:
            notes = moot_notes(cfg, {key}, launch)  # as if the user had given it
            why = moot.why(cfg, launch)
            named = any(n.startswith(f"{OPTION_BY_KEY[key].flag}") and why in n for n in notes)
            assert named == moot.applies(cfg, launch), (key, notes)
            applied += moot.applies(cfg, launch)
    assert applied, f"no mode above exercises {moot.keys}"


def test_a_default_or_a_value_resolve_filled_in_is_never_named():
    cfg = resolved(["--data", "/d", "--loader", "dali"])
    assert "data.workers" not in given_keys(Config())
    notes = []
    resolved(["--data", "/d", "--loader", "dali"], notes=notes)  # --workers auto, filled in
    assert not any("--workers" in n for n in notes) and cfg.data.workers is not None


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--loader", "synthetic", "--data", "/d", "--exclude-list", "/no/such/file"],
         "--data, --exclude-list: unused with --loader synthetic"),
        (["--loader", "synthetic", "--workers", "3", "--dali-threads", "2", "--val-crop-size",
          "200", "--eval-every", "2"],
         "--workers, --dali-threads, --val-crop-size, --eval-every: unused with --loader "
         "synthetic"),
        (["--data", "/d", "--loader", "dali", "--workers", "3"],
         "--workers: unused with --loader dali"),
        (["--data", "/d", "--loader", "torchvision", "--dali-prefetch", "2"],
         "--dali-prefetch: unused with --loader torchvision"),
        (["--data", "/d", "--synthetic-steps", "5"],
         "--synthetic-steps: unused with --loader dali"),
        (["--data", "/d", "--lars-eta", "0.01"], "--lars-eta: unused with --opt sgd"),
        (["--data", "/d", "--profile-wait", "3"], "--profile-wait: unused without --profile"),
        (["--data", "/d", "--dist-timeout", "30"], "--dist-timeout: unused in one process"),
        (["--data", "/d", "--tune-kernels", "later"], "--tune-kernels: unused: no kernel is tuned"),
        (["--data", "/d", "--compile", "--compile-mode", "default", "--tune-kernels", "later"],
         "--tune-kernels: unused: no kernel is tuned"),
        (["--data", "/d", "--test-only", "--weights", __file__, "--lr", "0.3", "--epochs", "3"],
         "--lr, --epochs: unused by evaluate (--test-only)"),
    ],
)  # fmt: skip
def test_what_a_user_gives_and_the_mode_does_not_read_is_named_once(flags, named):
    notes = []
    resolved(flags, notes=notes)
    assert sum(named in n for n in notes) == 1, notes


def test_dalis_cpu_mode_names_the_hardware_decoders_share():
    notes = []
    resolved(["--data", "/d", "--loader", "dali", "--dali-hw-decoder-load", "0.5"], cuda=False,
             notes=notes)  # fmt: skip
    assert any(n.startswith("--dali-hw-decoder-load: unused in DALI's CPU mode") for n in notes)


def test_a_step_schedule_that_never_decays_says_so():
    notes = []
    resolved(["--data", "/d", "--epochs", "12"], notes=notes)
    assert any(n.startswith("the LR never decays in this run") and "the run has 12" in n
               for n in notes)  # fmt: skip
    for flags in (["--epochs", "31"], ["--epochs", "12", "--lr-step-epochs", "4"],
                  ["--epochs", "12", "--lr-schedule", "cosine"]):  # fmt: skip
        notes = []
        resolved(["--data", "/d", *flags], notes=notes)
        assert not any("never decays" in n for n in notes), flags
    notes = []  # evaluate trains nothing: no schedule to speak of
    resolved(["--data", "/d", "--test-only", "--weights", __file__, "--epochs", "12"], notes=notes)
    assert not any("never decays" in n for n in notes)


def test_tuning_later_is_read_where_kernels_are_tuned_and_refused_for_several_processes():
    notes = []
    cfg = resolved(["--data", "/d", "--compile", "--tune-kernels", "later"], notes=notes)
    assert cfg.train.tune_kernels == "later" and not any("--tune-kernels" in n for n in notes)
    with pytest.raises(UserError, match=r"^--tune-kernels later: one process only \(2 here"):
        resolved(["--data", "/d", "--compile", "--tune-kernels", "later"], world=2)
    # the default: later for one process, at the first step for several
    assert resolved(["--data", "/d", "--compile"]).train.tune_kernels == "later"
    assert resolved(["--data", "/d", "--compile"], world=2).train.tune_kernels == "first-step"
    given = ["--data", "/d", "--compile", "--tune-kernels", "first-step"]
    assert resolved(given).train.tune_kernels == "first-step"
