"""scripts/ncu_details_summary.py: an ncu details-page CSV log to per-kernel medians (CPU)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "ncu_details_summary.py")
_spec = importlib.util.spec_from_file_location("ncu_details_summary", _PATH)
nds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nds)

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
        '"Metric Value","Rule Name","Rule Type","Rule Description","Estimated Speedup Type",'
        '"Estimated Speedup"')


def _row(launch, kernel, grid, metric, unit, value, rule="", text=""):
    return (f'"{launch}","1","python3","h","{kernel}","1","7","(128, 1, 1)","{grid}","0","9.0",'
            f'"GPU Speed Of Light Throughput","{metric}","{unit}","{value}","{rule}","OPT",'
            f'"{text}","",""')


def test_medians_per_kernel_and_grid_with_rules():
    lines = ["==PROF== Connected to process 1", HEAD,
             _row(0, "tree", "(2, 16, 8)", "Duration", "ns", "1,000"),
             _row(0, "tree", "(2, 16, 8)", "DRAM Throughput", "%", "40.0"),
             _row(0, "tree", "(2, 16, 8)", "Elapsed Cycles", "cycle", "9"),  # not kept
             _row(0, "tree", "(2, 16, 8)", "", "", "", "HighPipeUtilization", "ALU 34%"),
             _row(1, "tree", "(2, 16, 8)", "Duration", "ns", "3,000"),
             _row(2, "tree", "(2, 16, 8)", "Duration", "ns", "2,000"),
             _row(3, "tree", "(4, 16, 8)", "Duration", "ns", "7"),
             "==PROF== Disconnected from process 1"]
    out = nds.summarise(lines)
    assert [(k["kernel"], k["grid"], k["launches"]) for k in out] == [
        ("tree", "(2, 16, 8)", 3), ("tree", "(4, 16, 8)", 1)]
    first = out[0]
    assert first["median"] == {"Duration": 2000.0, "DRAM Throughput": 40.0}
    assert first["units"]["Duration"] == "ns"
    assert first["rules"] == {"HighPipeUtilization": "ALU 34%"}
    assert nds.summarise(["no csv here"]) == []


def test_summary_records_command_gpu_and_date(tmp_path):
    log = tmp_path / "ncu.csv"
    log.write_text("\n".join([HEAD, _row(0, "tree", "(2, 16, 8)", "Duration", "ns", "1,000")]))
    out = tmp_path / "s.json"
    assert nds.main([str(log), "--out", str(out), "--gpu", "NVIDIA H200", "--note", "n"]) == 0
    res = __import__("json").loads(out.read_text())
    assert res["gpu"] == "NVIDIA H200" and res["note"] == "n"
    assert res["command"].endswith(f"{log} --out {out} --gpu NVIDIA H200 --note n")
    assert res["date"].startswith("20") and res["files"]["ncu.csv"][0]["kernel"] == "tree"
