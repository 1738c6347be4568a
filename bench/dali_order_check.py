"""Do two GPU DALI loaders with the same seed yield the same labels, batch by batch? (A GPU test
of the hand-offs compares them; this prints where they part.)

Usage: python bench/dali_order_check.py"""

import tempfile

import torch

from fasttrain.data.dali import DaliLoader
from fasttrain.data.folder import scan_folder
from fasttrain.data.sample import SampleSpec, build_sample

root = build_sample(tempfile.mkdtemp(), SampleSpec(classes=4, train_per_class=48, val_per_class=25))
samples = [(p, i) for i, (p, _) in enumerate(scan_folder(root).train)]


def labels(**kw):
    ld = DaliLoader(
        samples,
        train=True,
        image_size=32,
        batch_size=32,
        threads=2,
        hw_decoder_load=0.99,
        seed=0,
        rank=0,
        world=1,
        local_rank=0,
        device=torch.device("cuda"),
        channels_last=True,
        **kw,
    )
    out = []
    for e in (0, 1):
        ld.set_epoch(e)
        out += [y.tolist()[:6] for _, y in ld]
    return out


a, b = labels(), labels()
print("host vs host, same seed:", a == b)
for i, (x, y) in enumerate(zip(a, b, strict=True)):
    print(i, x, y)
s = labels(handoff="stream")
print("host vs stream:", a == s)
print("host vs prefetch 4:", a == labels(prefetch=4))
