"""benchmarks/report.py writes its tables and plots from the numbers it is given (the measuring
itself is the benchmarks' job and too slow for CI)."""
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plots need matplotlib (pip install 'zero[bench]')")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture()
def report(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location("zero_bench_report", BENCH / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


def test_each_section_writes_a_stamped_table_and_a_plot(report, tmp_path):
    from zero.estimate import estimate_memory

    psi = 465_664
    formula = {s: {n: estimate_memory(psi, n, stage=s, offload="none", dtype="fp32")[0].model_states_total
                   for n in range(1, 9)} for s in range(4)}
    report.write_memory({"psi": psi, "worlds": [1, 2, 4], "formula": formula,
                         "measured": {s: {n: formula[s][n] + 64 for n in (1, 2, 4)} for s in range(4)}})
    rows = {"ddp": (0.010, 7e6, 9e6, 3e8), "zero3": (0.020, 2e6, 4e6, 3e8), "fsdp2": (0.015, 2e6, 5e6, 3e8),
            "zero1": "n/a (RuntimeError: no)"}
    report.write_speed({"rows": rows, "psi": psi, "world": 2, "layers": 4, "embd": 256})
    bench_adam = sys.modules.get("bench_adam") or __import__("bench_adam")
    adam_rows = [bench_adam.Row("torch AdamW (default)", 10**7, False, 0.1, "", 20.0, 0.5),
                 bench_adam.Row("zero CPUAdam", 10**7, False, 0.02, "", 20.0, 0.9),
                 bench_adam.Row("DeepSpeedCPUAdam", 10**7, False, None, "deepspeed is not installed", 20.0, 0.0)]
    report.write_adam({"rows": adam_rows, "n": 10**7, "threads": 2})
    for name, image in (("memory", "memory_vs_world.png"), ("step_time", "step_time.png"),
                        ("peak_memory", "peak_memory.png"), ("cpu_adam", "cpu_adam.png")):
        text = (tmp_path / f"{name}.md").read_text()
        assert "commit " in text and "torch " in text and f"]({image})" in text, name
        assert (tmp_path / image).stat().st_size > 10_000, image  # a real PNG
    step = (tmp_path / "step_time.md").read_text()
    assert "| zero3 | 20.0 | 2.00x |" in step and "0.80x" in step and "n/a (RuntimeError: no)" in step
    adam = (tmp_path / "cpu_adam.md").read_text()
    assert "| zero CPUAdam | - | 20.00 | 14.0 | 90% | 5.00x |" in adam and "deepspeed is not installed" in adam
    assert "| stage 3 |" in (tmp_path / "memory.md").read_text()
