"""``bench/gpu_targets.py``: the GPU targets read off GPU checks' JSONs, several calls read as one."""

import json

import pytest
from helpers import bench_script
from test_bench import ROOT, run_bench


@pytest.fixture(scope="module")
def targets():
    return bench_script("gpu_targets")


def step_row(shape, variant, ratio, lo, hi, coverage=0.98):
    return {"shape": shape, "variant": variant, "ratio": ratio, "ci": [lo, hi], "coverage": coverage}


def memory_row(recipe, model, ratio):
    return {"recipe": recipe, "model": model, "measured_over_planned": ratio}


FIRST = {  # a run whose memory section failed and whose step section ran out of time after six rows
    "device_name": "a GPU",
    "sections": {
        "extract": {"extract_over_plain_time": 1.12, "ci": [1.08, 1.16], "coverage": 0.75},
        "memory": {"error": "OutOfMemoryError: CUDA out of memory"},
        "step": {
            "rows": [
                step_row("gqa", "full", 1.009, 1.002, 1.0101),  # the interval reaches past 1.010
                step_row("mha", "full", 1.07, 1.06, 1.08),  # at the target: met
                step_row("gqa", "first-4", 1.02, 1.011, 1.03),  # above: missed
                step_row("mha", "first-4", 1.0, 1.0, 1.0),
                step_row("gqa", "last-4", 1.0, 1.0, 1.0),
                step_row("mha", "last-4", 1.0, 1.0, 1.0),
            ],
            "skipped": [{"row": "gqa:dilated-8", "why": "spent"}, {"row": "mha:dilated-8", "why": "spent"}],
        },
    },
}
SECOND = {  # the next call: what the first skipped or lost; its failed extraction does not replace the first's
    "device_name": "a GPU",
    "sections": {
        "extract": {"error": "RuntimeError: lost"},
        "fsdp": {"measured_over_planned": 1.0501},
        "memory": {
            "rows": [memory_row("lime-1b-gqa", "LIMe", 1.0499), memory_row("lime-1b-gqa", "LLaMA", 0.9)]
        },
        "step": {
            "rows": [step_row("gqa", "dilated-8", 1.0, 1.0, 1.0), step_row("mha", "dilated-8", 1.0, 1.0, 1.0)]
        },
    },
}


def test_each_target_reads_its_interval_or_its_one_measurement(targets):
    merged = targets.merged([FIRST, SECOND])
    got = {t: (m, v) for t, m, v in targets.readings(merged)}
    assert got == {
        "every Table 17 row measured in one run": ("8 of 8 in 2 calls", "missed: not in one run"),
        "GQA full step / LLaMA's <= 1.010": ("1.009 [1.002, 1.010]", "not resolved"),
        "MHA full step / LLaMA's <= 1.080": ("1.070 [1.060, 1.080]", "met"),
        "GQA first-4 step / LLaMA's <= 1.010": ("1.020 [1.011, 1.030]", "missed"),
        "bf16 extraction / plain forward <= 1.15": (
            "1.120 [1.080, 1.160]",
            "not resolved (a 75 % interval: too few rounds for 95 %)",
        ),
        "plan within 5 %, lime-1b-gqa LIMe": ("1.04990", "met"),
        "plan within 5 %, lime-1b-gqa LLaMA": ("0.90000", "missed"),
        "plan within 5 %, FSDP2 step": ("1.05010", "missed"),
        "routed backward, compiled, both shapes: the sources' fused pass / the readers' own": ("", "not run"),
    }
    first = {t: (m, v) for t, m, v in targets.readings(targets.merged([FIRST]))}
    assert first["every Table 17 row measured in one run"] == (
        "6 of 8",
        "missed: not gqa dilated-8, mha dilated-8",
    )
    assert first["plan within 5 %, memory rows"] == ("", "failed: OutOfMemoryError: CUDA out of memory")
    assert first["plan within 5 %, FSDP2 step"] == ("", "not run")


def test_the_table_of_a_recorded_run_and_a_bad_file(targets, tmp_path):
    """The H200's first run: three of eight rows, its GQA full interval [1.022, 1.055] above 1.010."""
    path = ROOT / "bench" / "gpu" / "gpu_check-h200-2026-12-04.json"
    lines = run_bench("gpu_targets.py", str(path)).stdout.splitlines()
    assert lines[0] == json.loads(path.read_text())["device_name"] + ": the GPU targets"
    assert "| GQA full step / LLaMA's <= 1.010 | 1.033 [1.022, 1.055] | missed |" in lines
    assert any(
        line.startswith("| every Table 17 row measured in one run | 3 of 8 | missed: not ") for line in lines
    )
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    err = run_bench("gpu_targets.py", str(bad), ok=False).stderr.strip()
    assert "bad.json: not a GPU check's JSON" in err and len(err.splitlines()) == 1


def kernel_row(shape, *variants):
    return {
        "shape": shape,
        "result": {"rows": [{"variant": "readers", "x_readers": 1.0, "ci": [1.0, 1.0]}, *variants]},
    }


def test_the_run_says_whether_the_compiled_backward_keeps_the_sources_fused_pass(targets):
    def fused(x, lo, hi):
        return {"variant": "source, triton", "x_readers": x, "ci": [lo, hi]}

    kernel = {
        "compiled_rows": [
            kernel_row("gqa", fused(0.8, 0.7, 0.9)),
            kernel_row("mha", fused(1.5, 1.3, 1.7)),
            kernel_row("gqa", {"variant": "source, torch", "x_readers": 1.9, "ci": [1.7, 2.2]}),  # a CPU's
        ]
    }
    got = targets.readings({"sections": {"kernel": kernel}})[-3:]
    name = "routed backward, compiled, {}: the sources' fused pass / the readers' own"
    assert got == [
        (name.format("GQA"), "0.800 [0.700, 0.900]", "the fused pass is faster: keep it"),
        (name.format("MHA"), "1.500 [1.300, 1.700]", "the readers' own is faster: make it the CUDA default"),
        (name.format("GQA"), "", "no Triton kernel ran"),
    ]
