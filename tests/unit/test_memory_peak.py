"""scripts/memory_peak.py: what was live at a CUDA memory snapshot's peak (synthetic snapshots
in torch.cuda.memory._snapshot()'s documented format)."""

from __future__ import annotations

import json
import pickle
import sys

import pytest

from tests.conftest import load_script

GIB = 1024**3


@pytest.fixture(scope="module")
def mp():
    yield load_script("memory_peak")
    sys.modules.pop("memory_peak", None)


def frame(filename, line=1, name="f"):
    return {"filename": filename, "line": line, "name": name}


OPT = [frame("??", 0, "at::native::zeros_like"),
       frame("/work/main/torchtitan/components/optimizer.py", 120, "step"),
       frame("/work/main/torchtitan/train.py", 400, "train_step")]
ACT = [frame("/tmp/torchinductor_root/ab/cabcdef.py", 77, "call"),
       frame("/usr/lib/python3.12/dist-packages/torch/_dynamo/eval_frame.py", 9, "_fn"),
       frame("/work/main/torchtitan/models/common/decoder.py", 88, "forward")]
LOGITS = [frame("/usr/local/lib/python3.12/dist-packages/torch/nn/functional.py", 5, "linear"),
          frame("/tmp/compare_upstream/site/torchao/float8/float8_linear.py", 3, "forward"),
          frame("/tmp/upstream/torchtitan/models/llama3/model.py", 301, "forward")]


BWD = [frame("/tmp/torchinductor_root/xy/cbwd.py", 12, "call"),
       frame("/usr/lib/python3.12/dist-packages/torch/autograd/function.py", 3, "apply")]


class Recorder:
    """An allocator's trace, written as the caching allocator records it."""

    def __init__(self):
        self.trace, self.live, self.segments_total, self.t = [], {}, 0, 0
        self.next_addr = 1 << 20

    def _entry(self, action, addr, size, frames=()):
        self.t += 1000
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                           "frames": list(frames), "time_us": self.t})

    def reserve(self, size):
        self._entry("segment_map", 0, size)
        self.segments_total += size

    def alloc(self, size, frames):
        addr, self.next_addr = self.next_addr, self.next_addr + size
        self._entry("alloc", addr, size, frames)
        self.live[addr] = (size, list(frames))
        return addr

    def free(self, addr):
        size, _ = self.live.pop(addr)
        self._entry("free_requested", addr, size)
        self._entry("free_completed", addr, size)

    def snapshot(self, drop_first=0, extra_live=()):
        blocks = [{"address": a, "size": s, "requested_size": s, "state": "active_allocated",
                   "frames": f} for a, (s, f) in self.live.items()]
        blocks += [{"address": a, "size": s, "requested_size": s, "state": "active_allocated",
                    "frames": []} for a, s in extra_live]
        blocks.append({"address": 1, "size": 5, "requested_size": 5, "state": "inactive",
                       "frames": []})
        total = self.segments_total + sum(s for _, s in extra_live)
        return {"segments": [{"device": 0, "address": 0, "total_size": total, "stream": 0,
                              "segment_type": "large", "allocated_size": 0, "active_size": 0,
                              "blocks": blocks}],
                "device_traces": [self.trace[drop_first:]]}


def two_steps():
    """Two training steps: optimizer state made in step 1, activations peaking in each
    forward, a one-off 20 GiB buffer in step 1 only."""
    r = Recorder()
    r.reserve(48 * GIB)
    params = r.alloc(7 * GIB, [frame("/w/torchtitan/train.py", 50, "build_model")])
    for step in range(2):
        acts = [r.alloc(3 * GIB, ACT) for _ in range(4)]
        logits = r.alloc(2 * GIB, LOGITS)
        if step == 0:
            scratch = r.alloc(20 * GIB, [frame("??", 0, "c10::cuda::alloc")])
            r.free(scratch)
        r.free(logits)
        for a in acts:
            r.free(a)
        grads = r.alloc(7 * GIB, BWD)
        if step == 0:
            state = r.alloc(14 * GIB, OPT)
        r.free(grads)
    return r, params, state


def test_peak_is_found_and_grouped_by_allocation_site(mp):
    r, *_ = two_steps()
    report = mp.analyze(r.snapshot())
    # step 1's forward: params 7 + activations 12 + logits 2 + scratch 20 = 41 GiB
    assert report.peak_allocated == 41 * GIB
    assert report.live_blocks == 7
    groups = {label: (size, n) for label, size, n in report.groups}
    # compiled code called from the trainer: the trainer's frame names the place
    assert groups["torchtitan/models/common/decoder.py:88 forward"] == (12 * GIB, 4)
    assert groups["torchtitan/train.py:50 build_model"] == (7 * GIB, 1)
    # torchao installed with --target is a library: the trainer's frame names the place
    assert groups["torchtitan/models/llama3/model.py:301 forward"] == (2 * GIB, 1)
    assert groups[mp.NO_PYTHON] == (20 * GIB, 1)
    assert report.reserved_at_peak == report.peak_reserved == 48 * GIB
    # by slices: the first holds step 1's peak, the last ends at the snapshot's state
    assert report.slices[0][1] <= 41 * GIB and max(a for _, a, _ in report.slices) == 41 * GIB
    assert report.slices[-1][1] >= 21 * GIB


def test_group_label_prefers_the_training_code(mp):
    assert mp.group_label(BWD) == "compiled graph cbwd.py (call)"
    assert mp.group_label(OPT) == "torchtitan/components/optimizer.py:120 step"
    assert mp.group_label(LOGITS[:2]) == "torch/nn/functional.py:5 linear"
    assert mp.group_label([frame("??")]) == mp.NO_PYTHON
    assert mp.group_label([]) == mp.NO_STACK


@pytest.mark.parametrize("after", ["half", "50%"])
def test_after_finds_the_steady_state_peak(mp, after):
    r, *_ = two_steps()
    half = r.trace[len(r.trace) // 2]["time_us"] - r.trace[0]["time_us"]
    report = mp.analyze(r.snapshot(), after=(half / 1e6, False) if after == "half" else
                        mp.after_arg(after))
    # step 2's forward: params 7 + state 14 + activations 12 + logits 2 (no scratch)
    assert report.peak_allocated == 35 * GIB
    groups = {label: size for label, size, _ in report.groups}
    assert groups["torchtitan/components/optimizer.py:120 step"] == 14 * GIB
    assert mp.NO_PYTHON not in groups


def test_blocks_allocated_before_the_window_are_named_so(mp):
    r, params, _ = two_steps()
    # the ring buffer dropped the first events (the parameters' and step 1's allocations)
    report = mp.analyze(r.snapshot(drop_first=3))
    groups = {label: size for label, size, _ in report.groups}
    # still live at the end: the snapshot's block carries its stack
    assert groups["torchtitan/train.py:50 build_model"] == 7 * GIB
    assert report.peak_allocated == 41 * GIB
    # a block allocated before the window and freed inside it has no allocation stack
    r2 = Recorder()
    r2.reserve(8 * GIB)
    early = r2.alloc(4 * GIB, ACT)
    r2.alloc(1 * GIB, OPT)
    r2.free(early)
    report = mp.analyze(r2.snapshot(drop_first=2))
    groups = {label: size for label, size, _ in report.groups}
    assert report.peak_allocated == 5 * GIB
    assert groups[mp.BEFORE_WINDOW] == 4 * GIB


def test_snapshot_without_history_lists_what_is_live(mp):
    r, *_ = two_steps()
    snap = r.snapshot()
    snap["device_traces"] = [[]]
    report = mp.analyze(snap)
    assert not report.has_history
    assert report.peak_allocated == 21 * GIB
    text = mp.format_report("", report, top=5)
    assert "no allocator history" in text and "21.00 GiB allocated" in text


@pytest.mark.parametrize("filename,kind", [
    ("/work/main/torchtitan/train.py", "project"),
    ("/usr/lib/python3.12/site-packages/torchtitan/train.py", "project"),
    ("/home/me/my_train_script.py", "project"),
    ("/usr/lib/python3.12/dist-packages/torch/nn/modules/module.py", "library"),
    ("/tmp/compare_upstream/site/torchao/float8/float8_linear.py", "library"),
    ("/usr/lib/python3.12/threading.py", "library"),
    ("/tmp/torchinductor_root/ab/cab.py", "compiled"),
    ("??", "native"),
    ("<eval_with_key>.3", "native"),
])
def test_frame_kinds(mp, filename, kind):
    assert mp.frame_kind(filename) == kind


def test_cli_prints_tables_and_json(mp, tmp_path, capsys):
    r, *_ = two_steps()
    folder = tmp_path / "memory_snapshot" / "iteration_10"
    folder.mkdir(parents=True)
    (folder / "rank0_memory_snapshot.pickle").write_bytes(pickle.dumps(r.snapshot()))
    out = tmp_path / "peak.json"
    assert mp.main([f"ours={tmp_path}", "--top", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## ours: " in text and "peak allocated: 41.00 GiB at 0.01 s" in text
    assert "| 20.000 | 1 | (no Python frame" in text
    assert "| 12.000 | 4 | torchtitan/models/common/decoder.py:88 forward |" in text
    assert "| 9.000 | 2 | (2 more places) |" in text
    data = json.loads(out.read_text())
    assert data["ours"]["peak_allocated"] == 41 * GIB


@pytest.mark.parametrize("make,message", [
    (lambda p: None, "no such file or folder"),
    (lambda p: p.write_text("not a pickle"), "not a memory snapshot pickle"),
    (lambda p: p.write_bytes(pickle.dumps([1, 2])), "not a CUDA memory snapshot"),
    (lambda p: p.mkdir(), "no rank0_memory_snapshot.pickle below this folder"),
])
def test_bad_inputs_are_one_line(mp, tmp_path, capsys, make, message):
    path = tmp_path / "snap.pickle"
    make(path)
    assert mp.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_bad_options_are_one_line(mp, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mp.main([str(tmp_path), "--json", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is a folder" in capsys.readouterr().err
    for bad in ("-1", "120%", "x%"):
        with pytest.raises(SystemExit):
            mp.main([str(tmp_path), "--after", bad])
        assert capsys.readouterr().err.startswith("error: argument --after")
