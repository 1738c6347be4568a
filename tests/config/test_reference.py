"""The flag reference and the command line's compatibility: docs/FLAGS.md is what the schema
generates, and every flag and YAML key of the 0.1 line is still there, meaning the same key."""

from __future__ import annotations

from pathlib import Path

from fasttrain.config import OPTIONS
from fasttrain.config.reference import markdown

REPO = Path(__file__).resolve().parents[2]

# key, flag, other spellings: what recipes, scripts and saved config.yaml files use
KEPT = """
data.path --data | data.loader --loader | data.exclude_list --exclude-list
data.image_size --image-size --train-crop-size | data.progressive_resizing --progressive-resizing
data.auto_augment --auto-augment | data.val_resize_size --val-resize-size
data.val_crop_size --val-crop-size | data.workers --workers -j
data.synthetic_steps --synthetic-steps | data.dali_threads --dali-threads
data.dali_prefetch --dali-prefetch | data.dali_hw_decoder_load --dali-hw-decoder-load
model.arch --arch --model | model.num_classes --num-classes | model.channels_last --channels-last
model.zero_init_residual --zero-init-residual | model.weights --weights
model.fused_bn --fused-bn | model.cudnn_bn --cudnn-bn | optim.lr --lr
optim.lr_scaling --lr-scaling | optim.momentum --momentum | optim.weight_decay --weight-decay
optim.bn_weight_decay --bn-weight-decay | optim.warmup_epochs --warmup-epochs --lr-warmup-epochs
optim.lr_schedule --lr-schedule --lr-scheduler --sched
optim.lr_step_epochs --lr-step-epochs --lr-step-size | optim.lr_gamma --lr-gamma
optim.clip_grad_norm --clip-grad-norm --clip-grad | optim.lr_power --lr-power
optim.label_smoothing --label-smoothing --smoothing | optim.opt --opt | optim.lars_eta --lars-eta
train.epochs --epochs | train.max_steps --max-steps | train.batch_size --batch-size -b
train.batch_sizes --batch-sizes | train.accum_steps --accum-steps | train.amp --amp
train.compile --compile | train.compile_mode --compile-mode
train.inductor_options --inductor-options | train.cuda_graphs --cuda-graphs
train.triton_kernels --triton-kernels | train.strategy --strategy
train.bucket_cap_mb --bucket-cap-mb | train.broadcast_buffers --broadcast-buffers
train.sync_bn --sync-bn | train.ddp_comm_hook --ddp-comm-hook | train.dist_timeout --dist-timeout
train.on_nan --on-nan | train.device --device | train.random_erase --random-erase
train.mixup_alpha --mixup-alpha --mixup | train.cutmix_alpha --cutmix-alpha --cutmix
train.mixup_prob --mixup-prob | train.mixup_switch_prob --mixup-switch-prob
train.model_ema --model-ema | train.model_ema_decay --model-ema-decay
train.model_ema_steps --model-ema-steps | train.model_ema_warmup --model-ema-warmup
train.deterministic --deterministic | train.seed --seed | run.output_dir --output-dir
run.name --name | run.test_only --test-only | run.resume --resume
run.log_every --log-every --print-freq | run.eval_every --eval-every
run.ckpt_every_steps --ckpt-every-steps | run.keep_checkpoints --keep-checkpoints
run.profile --profile | run.profile_wait --profile-wait | run.profile_warmup --profile-warmup
run.profile_active --profile-active | run.profile_repeat --profile-repeat
"""


def test_the_flag_reference_is_what_the_schema_generates():
    written = (REPO / "docs" / "FLAGS.md").read_text()
    assert written == markdown(), "run: python -m fasttrain.config.reference > docs/FLAGS.md"


def test_the_reference_names_every_flag_and_key():
    text = markdown()
    for o in OPTIONS:
        assert f"`{o.flag}`" in text and f"`{o.key}`" in text, o.key
    assert "`--no-fused-bn`: `off`" in text  # the switch's spellings


def test_every_flag_and_key_of_earlier_releases_is_kept():
    kept = {tuple(entry.split()) for line in KEPT.strip().splitlines() for entry in line.split("|")}
    now = {(o.key, o.flag, *o.aliases) for o in OPTIONS}
    assert kept <= now, kept - now
