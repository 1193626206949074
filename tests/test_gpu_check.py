"""`experiments/gpu_check.py --cpu --tiny`: every stage of the GPU check runs on CPU (kernels in
interpret mode, a tiny model, HF on CPU), so a Python error never costs GPU time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_tiny_passes_every_stage(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--cpu", "--tiny",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = report["stages"]
    assert {name: s["status"] for name, s in stages.items()} == {
        "0 env": "ok", "1 compile": "ok", "2 correctness": "ok", "3 kernel table": "ok", "4 engine": "ok"}
    assert all(r["ok"] for r in stages["2 correctness"]["cases"])
    assert not any(r.get("error") for r in stages["3 kernel table"]["rows"])
    engine = stages["4 engine"]
    assert engine["smollm2 pallas vs xla"]["verdicts"] == ["same", "same"]
    bench = engine["throughput vs HF"]
    assert bench["llmjax xla"]["output_tok_s"] > 0 and bench["hf generate"]["2"]["output_tok_s"] > 0
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check")


def test_carried_wheels_are_joined_and_checked(tmp_path, monkeypatch):
    """A split wheel is rejoined only when every part is there and the SHA-256 matches."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import gpu_check

    import hashlib
    data = b"wheel bytes " * 1000
    name = "pkg-1.0-py3-none-any.whl"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / f"{name}.part0").write_bytes(data[:5000])
    (tmp_path / "a" / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  {name}\n")
    monkeypatch.setattr(gpu_check, "WHEEL_DIRS", [tmp_path])
    assert gpu_check.join_split_wheels(tmp_path / "out") == []  # part1 missing
    (tmp_path / "b" / f"{name}.part1").write_bytes(data[5000:])
    [joined] = gpu_check.join_split_wheels(tmp_path / "out")
    assert joined.name == name and joined.read_bytes() == data
    (tmp_path / "b" / f"{name}.part0").write_bytes(data[:5000])  # a part in two folders (kept from a call)
    [joined] = gpu_check.join_split_wheels(tmp_path / "out")
    assert joined.read_bytes() == data


def test_a_stage_over_its_cap_stops_though_it_catches_exceptions(tmp_path):
    """A stage whose parts catch `Exception` (one failing kernel must not stop the others) still
    stops at its cap, with the status saying so."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import time

    import gpu_check

    def stubborn(report, args):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except Exception:  # noqa: BLE001  as the stages' per-case handlers
                pass

    report = gpu_check.Report([tmp_path])
    start = time.monotonic()
    gpu_check.run_stage(report, "stubborn", 1, stubborn, None)
    assert time.monotonic() - start < 5
    assert report.data["stages"]["stubborn"]["status"].startswith("StageTimeout")
