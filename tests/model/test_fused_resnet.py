"""The fused ResNet against torchvision's: the same state dict, logits, gradients and running
statistics with each of its options; one graph under torch.compile; its stem on fasttrain's
Triton max-pool; and no Triton needed where the model runs on torch's ops."""

import subprocess
import sys

import pytest
import torch
import torchvision

from fasttrain.model.fused_resnet import FusedResNet
from tests.conftest import (
    assert_matches_torchvision,
    partitioned_backward,
    partitioned_graphs,
    randn_nhwc,
)

# the Triton max-pool runs on the GPU where there is one, else interpreted on the CPU
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "arch, fold, mask_from_input, store_block_grad, fuse_stem, pad_stem",
    [
        ("resnet18", {1, 3}, False, False, False, False),
        ("resnet50", {1, 3}, False, False, False, False),
        ("resnet50", {3}, False, False, False, False),
        ("resnet50", (), False, False, False, False),
        ("resnet18", (), True, False, False, False),
        ("resnet50", (), True, False, False, False),
        ("resnet18", (), True, True, False, False),
        ("resnet50", (), True, True, False, False),
        ("resnet18", (), False, False, True, False),
        ("resnet50", (), True, True, True, False),
        ("resnet18", (), False, False, False, True),
        ("resnet50", (), True, True, True, True),
        ("resnet50", (), True, "packed", True, True),
    ],
)
def test_fused_resnet_is_torchvisions_model_with_a_fused_forward(
    arch, fold, mask_from_input, store_block_grad, fuse_stem, pad_stem
):
    """The same weights, state dict, logits, gradients and running statistics as torchvision's
    ResNet, with every prologue folded into its convolution, only the 3x3 ones', or none (an
    elementwise pass each, its ReLU's gradient masked by its output or by its input), with
    each block end's masked gradient stored once, with the stem as torchvision's or its BN
    run as the others, and with the stem's image and weights padded to 4 channels or not;
    "packed": the block ends' stored gradient masked by the ReLU's bits (``pack_block_mask``)."""
    assert_matches_torchvision(
        arch,
        lambda arch, **kw: FusedResNet(
            arch,
            fold=fold,
            mask_from_input=mask_from_input,
            store_block_grad=bool(store_block_grad),
            pack_block_mask=store_block_grad == "packed",
            fuse_stem=fuse_stem,
            pad_stem=pad_stem,
            **kw,
        ),
    )


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_the_padded_stem_convolution_is_the_convolution(channels):
    """``_stem_conv`` pads an image of fewer than 4 channels and the weights with zero channels:
    the same output (channels_last kept) and the same weight and bias gradients as the
    convolution itself, fp64; an image of 4 channels is left as it is."""
    from fasttrain.model.fused_resnet import Fusion, _stem_conv

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(channels, 8, 7, 2, 3, bias=True).double()
    conv = conv.to(memory_format=torch.channels_last)
    x = randn_nhwc(2, channels, 20, 20, dtype=torch.float64)
    got = _stem_conv(conv, x, Fusion(pad_stem=True))
    got_grads = torch.autograd.grad(got.square().sum(), (conv.weight, conv.bias))
    want = conv(x)
    want_grads = torch.autograd.grad(want.square().sum(), (conv.weight, conv.bias))
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w)


def test_a_fused_checkpoint_loads_into_torchvision_and_back():
    torch.manual_seed(1)
    fused = FusedResNet("resnet50", num_classes=10)
    fused(
        randn_nhwc(2, 3, 32, 32, dtype=torch.float32)
    )  # a training forward moves the BN statistics
    plain = torchvision.models.resnet50(weights=None, num_classes=10)
    plain.load_state_dict(fused.state_dict(), strict=True)
    again = FusedResNet("resnet50", num_classes=10)
    again.load_state_dict(plain.state_dict(), strict=True)
    x = randn_nhwc(2, 3, 32, 32, seed=5, dtype=torch.float32)
    for m in (fused, plain, again):
        m.eval()
    torch.testing.assert_close(again(x), plain(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "mask_from_input, store_block_grad, fuse_stem, pad_stem",
    [(False, False, False, False), (True, False, False, False), (True, True, True, True)],
)
def test_the_fused_forward_traces_without_graph_breaks(
    mask_from_input, store_block_grad, fuse_stem, pad_stem
):
    model = FusedResNet(
        "resnet18",
        num_classes=4,
        mask_from_input=mask_from_input,
        store_block_grad=store_block_grad,
        fuse_stem=fuse_stem,
        pad_stem=pad_stem,
    )
    model = model.to(memory_format=torch.channels_last)
    explained = torch._dynamo.explain(model)(randn_nhwc(2, 3, 32, 32, dtype=torch.float32))
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize(
    "compiled, bn_in_pool",
    [(False, True), (False, False), pytest.param(True, True, marks=pytest.mark.slow)],
)
def test_the_fused_stem_runs_in_the_triton_maxpool_with_the_same_outputs(
    compiled, bn_in_pool, monkeypatch
):
    """FusedResNet (its stem's BN run as the others) with fasttrain's max-pool swapped in
    applies the stem's normalise + ReLU inside it, or with ``stem_bn_in_pool`` the
    whole BN, with the logits, gradients and running statistics of the same model on torch's
    max-pool (fp32; TF32 convolutions off on a GPU, whose rounding of each input would magnify
    the pool's one-ulp differences); both compiled into one graph, the same. The pool's backward
    kernel reads its gradient channels_last, as its tiles need for coalesced loads: compiled,
    inductor handed it the contiguous layout until the backward asked for channels_last."""
    from fasttrain.kernels import maxpool_rows
    from fasttrain.kernels.maxpool import MaxPool2d

    import fasttrain.model.fused_resnet as fused_resnet

    def model(triton: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        m = fused_resnet.FusedResNet("resnet18", num_classes=5, stem_bn_in_pool=bn_in_pool)
        if triton:
            m.maxpool = MaxPool2d(3, 2, 1)
        return m.to(DEV, memory_format=torch.channels_last)

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    launch, grads = maxpool_rows._bwd, []  # the stem's 3x3/2 pool: the row kernels

    class Spy:  # the backward kernel's launches, with the gradient each read
        def __getitem__(self, grid):
            return lambda g, *a, **k: grads.append(g) or launch[grid](g, *a, **k)

    monkeypatch.setattr(maxpool_rows, "_bwd", Spy())
    calls = []
    name = "bn_relu_max_pool2d" if bn_in_pool else "affine_relu_max_pool2d"
    pool = getattr(fused_resnet, name)
    monkeypatch.setattr(fused_resnet, name, lambda *a, **k: calls.append(1) or pool(*a, **k))
    # batch 4 at 64 px: layer4's BN normalises 16 values per channel (fewer make it near-singular,
    # and a compiled graph's other order of additions would show in the logits)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    x = x.to(DEV, memory_format=torch.channels_last)
    ours, ref = model(True), model(False)
    # compiled, both: the reference compiled too, so that only the pool differs between them
    run, run_ref = (torch.compile(m, fullgraph=True) if compiled else m for m in (ours, ref))
    out, out_ref = run(x), run_ref(x)
    assert calls == [1]
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    out_ref.sum().backward()
    assert len(grads) == 1 and grads[0].is_contiguous(memory_format=torch.channels_last)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
    torch.testing.assert_close(ours.bn1.running_var, ref.bn1.running_var)
    assert ours.bn1.num_batches_tracked == ref.bn1.num_batches_tracked == 1


def test_each_weight_is_cast_once_and_the_cast_kept_for_the_backward():
    """In fp16 with fp32 weights, ``cast_once`` keeps each convolution's cast from the forward
    for the backward, whose graph then casts no weight to fp16 again; the reference (the cast
    inside ``conv_bn``) casts each of the 19 that ``conv_bn`` runs (all but the stem's) again
    there. The gradients are the same both ways."""
    recasts, grads = {}, {}
    for once in (True, False):
        torch.manual_seed(0)
        model = FusedResNet("resnet18", num_classes=4, cast_once=once)
        model = model.to(memory_format=torch.channels_last)
        bw = partitioned_backward(
            model, randn_nhwc(2, 3, 32, 32, dtype=torch.float16), autocast=torch.float16
        )
        recasts[once] = [  # fp32 4-D inputs of the backward (the weights) cast to fp16 there
            n
            for n in bw.graph.nodes
            if n.op == "call_function"
            and any(name in str(n.target) for name in ("convert_element_type", "_to_copy"))
            and n.meta["val"].dtype == torch.float16
            and n.meta["val"].dim() == 4
            and n.args[0].op == "placeholder"
            and n.args[0].meta["val"].dtype == torch.float32
        ]
        grads[once] = [p.grad for p in model.parameters()]
    assert len(recasts[True]) == 0 and len(recasts[False]) == 19
    for a, b in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("fuse_stem", [True, False])
@pytest.mark.parametrize("count_once", [True, False])
def test_every_bns_batch_is_counted_as_torchvision_counts_it(count_once, fuse_stem, momentum):
    """With ``count_once`` (the default: every finalized BN's batch counted by one multi-tensor
    add before the first) or each BN counting its own, two training steps leave the state dict
    of torchvision's ResNet: each ``num_batches_tracked`` and the running statistics, also with
    momentum None (a cumulative average, which reads the count), with the stem's BN as
    torchvision runs it (it counts itself) or as the others, and with one BN frozen in eval mode
    (neither counted nor updated). Fails if a BN is counted twice or not at all."""
    models = []
    for build in (
        lambda: torchvision.models.resnet18(num_classes=5),
        lambda: FusedResNet("resnet18", num_classes=5, count_once=count_once, fuse_stem=fuse_stem),
    ):
        torch.manual_seed(0)
        model = build().double().to(memory_format=torch.channels_last)
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = momentum
        model.layer2[0].bn1.eval()  # frozen, as a fine-tuning recipe may hold some BNs
        models.append(model)
    for seed in (1, 2):
        x = randn_nhwc(4, 3, 32, 32, seed=seed)
        for model in models:
            model(x)
    ref, ours = (m.state_dict() for m in models)
    assert ours["layer1.0.bn1.num_batches_tracked"] == 2
    assert ours["layer2.0.bn1.num_batches_tracked"] == 0
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], msg=k)


@pytest.mark.parametrize("count_once", [True, False])
def test_the_batch_counts_are_one_op_in_the_compiled_forward(count_once):
    """Compiled, the forward graph AOTAutograd hands inductor counts the batch with one
    multi-tensor add for every BN (which inductor makes one kernel) where ``count_once``, and
    with one single-element add per BN (a kernel each: 20 in resnet18) where not."""
    torch.manual_seed(0)
    model = FusedResNet("resnet18", num_classes=4, count_once=count_once)
    model = model.to(memory_format=torch.channels_last)
    fw = partitioned_graphs(model, randn_nhwc(2, 3, 32, 32, dtype=torch.float32))["fw"]
    calls = [n for n in fw.graph.nodes if n.op == "call_function"]
    foreach = [n for n in calls if "_foreach_add" in str(n.target)]
    counts = [  # single-element integer adds: a BN's count
        n
        for n in calls
        if str(n.target).startswith("aten.add")
        and n.meta["val"].dtype == torch.int64
        and n.meta["val"].numel() == 1
    ]
    if count_once:
        assert len(foreach) == 1 and len(foreach[0].args[0]) == 20 and counts == []
    else:
        assert foreach == [] and len(counts) == 20
    assert model.layer4[1].bn2.num_batches_tracked == 1


def test_the_fused_model_needs_no_triton():
    """A CPU-only torch has no Triton: the fused model trains without importing it (its stem asks
    for fasttrain's Triton max-pool only where one exists). Fails if the stem imports it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any import of triton now fails
        "import torch\n"
        "from fasttrain.model.fused_resnet import FusedResNet\n"
        "m = FusedResNet('resnet18', num_classes=3)\n"
        "m(torch.randn(2, 3, 32, 32)).sum().backward()\n"
        "assert 'fasttrain.kernels.maxpool' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
