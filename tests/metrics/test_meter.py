"""The device-side meter's account of fp16 updates: the updates GradScaler skipped and the scale
it ends an interval with, over ranks and into the log."""

from __future__ import annotations

import torch

from fasttrain.metrics.log import Metrics
from fasttrain.metrics.meter import DeviceMeter

CPU = torch.device("cpu")


def test_a_lowered_scale_is_a_skipped_update_and_the_last_scale_is_kept():
    meter = DeviceMeter(CPU)
    meter.add_device(torch.tensor(2.0), torch.tensor(3.0), 4)
    meter.samples += 4
    scale = torch.tensor([65536.0])
    for after in (65536.0, 32768.0, 32768.0, 16384.0, 32768.0):  # two halvings, one growth
        meter.add_update(scale, torch.tensor([after]))
        scale = torch.tensor([after])
    totals = meter.collect().values()
    assert (totals.loss, totals.top1, totals.skipped, totals.loss_scale) == (2.0, 75.0, 2, 32768.0)
    meter.add_device(torch.tensor(2.0), torch.tensor(3.0), 4)  # an interval without updates
    meter.samples += 4
    totals = meter.collect().values()
    assert totals.skipped is None and totals.loss_scale is None  # no fp16: nothing to say


def test_the_log_records_the_scale_and_the_skipped_updates(tmp_path):
    metrics = Metrics(
        tmp_path, is_main=True, total_steps=2, start_step=0, world_size=1, device=CPU, sync=True
    )
    meter = DeviceMeter(CPU)
    for step, after in ((1, 1024.0), (2, 512.0)):
        meter.add_device(torch.tensor(1.0), torch.tensor(1.0), 2)
        meter.samples += 2
        meter.add_update(torch.tensor([1024.0]), torch.tensor([after]))
        metrics.step_done(2, 0.0, 0.0)
        logged = metrics.log_train(step, 0, meter, 0.1)
    metrics.close()
    record = logged[-1].record
    assert record["loss_scale"] == 512.0 and record["skipped_steps"] == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss_scale")] == [1024.0, 512.0]
    assert [e.value for e in events.Scalars("train/skipped_steps")] == [0.0, 1.0]
