"""Do two GPU DALI loaders with the same seed yield the same labels, batch by batch? (A GPU test
of the hand-offs compares them; this prints where they part.)

Usage: python bench/dali_order_check.py"""

import tempfile

import torch
from common import loader_args  # bench/common.py: the script's folder is on sys.path

from fasttrain.data.dali import DaliLoader
from fasttrain.data.folder import scan_folder
from fasttrain.data.sample import SampleSpec, build_sample

root = build_sample(tempfile.mkdtemp(), SampleSpec(classes=4, train_per_class=48, val_per_class=25))
samples = [(p, i) for i, (p, _) in enumerate(scan_folder(root).train)]


def labels(**kw):
    args = loader_args(32, 32, torch.device("cuda"))
    ld = DaliLoader(samples, threads=2, hw_decoder_load=0.99, local_rank=0, **args, **kw)
    out = []
    for e in (0, 1):
        ld.set_epoch(e)
        out += [y.tolist()[:6] for _, y in ld]
    return out


a, b = labels(prefetch=2), labels(prefetch=2)  # DALI's own depth, host hand-off
print("host vs host, same seed:", a == b)
for i, (x, y) in enumerate(zip(a, b, strict=True)):
    print(i, x, y)
s = labels(handoff="stream", prefetch=2)
print("host vs stream:", a == s)
print("host vs prefetch 4:", a == labels(prefetch=4))
