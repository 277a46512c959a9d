"""The benchmark scripts run as documented (at a toy size) and say what they claim to."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import bench_script

ROOT = Path(__file__).resolve().parent.parent
TOY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--batch", "1", "--seq", "8", "--threads", "1"]


def run_bench(script: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, cwd=ROOT
    )
    assert (done.returncode == 0) == ok, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def step_overhead():
    return bench_script("step_overhead")


@pytest.mark.slow
def test_step_overhead_prints_a_row_per_variant_and_scope_with_its_target():
    out = run_bench(
        "step_overhead.py",
        *TOY,
        "--vocab",
        "64",
        "--rounds",
        "6",
        "--memory-runs",
        "1",
        "--variants",
        "full",
        "last-1",
    ).stdout
    for scope in ("[stack]", "[model]"):
        assert scope in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["none"], ["full"], ["last-1"])]
    assert [r[0] for r in rows] == ["none", "full", "last-1"] * 2
    for row in rows:  # row, step s, time x, CI, min-max, best x, peak MB, mem x, then the target
        assert float(row[2]) > 0 and float(row[6]) == float(row[6])  # memory measured (toy: ~0 MB)
    assert all(r[2] == "1.000" for r in rows if r[0] == "none")
    assert all(" ".join(r[8:]).startswith("<= 1.10:") for r in rows if r[0] == "full")
    assert all(len(r) == 8 for r in rows if r[0] == "last-1")  # no target for last-1


@pytest.mark.slow
def test_step_overhead_rejects_a_bad_variant_in_one_line():
    done = run_bench("step_overhead.py", *TOY, "--no-memory", "--variants", "full+fast", ok=False)
    assert done.stderr.strip().splitlines()[-1] == "full+fast: the only row option is +recompute"


@pytest.mark.parametrize(
    ("lo", "hi", "coverage", "state"),
    [
        (1.01, 1.09, 0.96, "met"),
        (1.11, 1.2, 0.96, "missed"),
        (1.05, 1.12, 0.96, "not resolved"),
        (1.0, 1.01, 0.9, "too few rounds"),
    ],
)
def test_step_overhead_verdict(step_overhead, lo, hi, coverage, state):
    median = (lo + hi) / 2
    assert state in step_overhead.verdict("full", median, lo, hi, coverage, 20)
    assert step_overhead.verdict("last-1", median, lo, hi, coverage, 20) == ""


def test_an_unresolved_target_says_how_many_rounds_might_resolve_it(step_overhead):
    # 20 rounds, median 1.05, interval 1.00-1.15: the upper half-width 0.10 must shrink to the
    # 0.05 gap below 1.10, a factor 2 in width, so 2**2 = 4 times the rounds
    assert step_overhead.rounds_to_resolve(1.05, 1.00, 1.15, 20, 1.10) == 80
    # above the target the lower half-width counts: (0.02 / 0.01)**2 * 30 = 120
    assert step_overhead.rounds_to_resolve(1.06, 1.04, 1.20, 30, 1.05) == 120
    assert step_overhead.rounds_to_resolve(1.10, 1.00, 1.20, 20, 1.10) is None
    assert (
        step_overhead.verdict("full", 1.05, 1.00, 1.15, 0.96, 20)
        == "<= 1.10: not resolved (~80 rounds at this spread)"
    )
    assert (
        step_overhead.verdict("full", 1.10, 1.00, 1.15, 0.96, 20)
        == "<= 1.10: not resolved (median on the target)"
    )


def test_a_bench_model_is_made_on_its_device_not_moved_there(step_overhead):
    # a 1B model initialised on the host and then moved costs 10-20 s per model on the GPU check
    from torch.utils._python_dispatch import TorchDispatchMode

    class Devices(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen |= {
                t.device.type for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
            }
            return out

    args = argparse.Namespace(vocab=64, hidden=32, layers=2, heads=4, kv_heads=None, device="meta")
    with Devices() as devices:
        model = step_overhead.build("full", args)
    assert devices.seen == {"meta"}  # no tensor was ever made on the host
    assert {p.device.type for p in model.parameters()} == {"meta"} and model.training


@pytest.mark.slow
def test_step_overhead_profile_prints_an_operator_table_per_variant():
    out = run_bench(
        "step_overhead.py", *TOY, "--vocab", "64", "--rounds", "2", "--profile", "--variants", "full"
    ).stdout
    assert "median over 2 interleaved rounds" in out
    table = out.split("full: total", 1)[1].splitlines()
    assert table[1].split() == ["operator", "LLaMA", "full", "diff"]
    rows = [line.split() for line in table[2:14]]
    assert all(len(row) >= 4 and float(row[-3]) >= 0 for row in rows)
    # at this toy size the shared operators' differences are timing noise (aten::mm's fell out of the
    # top 12 in one CI run); the routed read's own operator, absent from LLaMA, always leads
    assert any(row[0] in ("_RoutedRead", "_RoutedReadBackward") and float(row[-3]) == 0 for row in rows)


def test_step_overhead_times_each_pair_in_both_build_orders(step_overhead, monkeypatch):
    calls = []

    def fake(flag, name, env=None, extra=()):
        calls.append((flag, name, list(extra)))
        n = int(extra[extra.index("--rounds") + 1])
        first = "--_variant-first" in extra
        return {role: {"stack": [float(first)] * n} for role in ("base", "variant")}

    monkeypatch.setattr(step_overhead, "in_subprocess", fake)
    args = argparse.Namespace(rounds=7, scopes=["stack"], processes=3)
    times = step_overhead.pair_times("full", args)
    assert calls == [
        ("--_pair-of", "full", ["--rounds", "3"]),
        ("--_pair-of", "full", ["--rounds", "2", "--_variant-first"]),
        ("--_pair-of", "full", ["--rounds", "2"]),
    ]
    assert times == {role: {"stack": [0.0] * 3 + [1.0] * 2 + [0.0] * 2} for role in ("base", "variant")}
    calls.clear()
    step_overhead.pair_times("full", argparse.Namespace(rounds=1, scopes=["stack"], processes=2))
    assert calls == [("--_pair-of", "full", ["--rounds", "1"])]  # never a process with no rounds


def test_step_overhead_aa_row_says_whether_its_interval_contains_one(step_overhead):
    assert step_overhead.verdict("a/a", 1.0, 0.97, 1.02, 0.96, 16) == "contains 1: no bias resolved"
    assert step_overhead.verdict("a/a", 1.0, 0.95, 0.99, 0.96, 16) == "excludes 1: the bench is biased"
    assert step_overhead.verdict("a/a", 1.0, 0.95, 0.99, 0.90, 16) == ""


def test_profile_takes_each_operators_median_over_steps_counting_absent_as_zero(step_overhead):
    # one burst step (mul 5x) must not move mul's figure, as a sum over steps would
    steps = [{"mm": 10.0, "mul": 1.0}, {"mm": 12.0, "mul": 5.0, "bmm": 3.0}, {"mm": 11.0, "mul": 1.2}]
    assert step_overhead.median_per_operator(steps) == {"mm": 11.0, "mul": 1.2, "bmm": 0.0}


@pytest.mark.slow
def test_kv_buffer_ab_against_head_gives_identical_values_and_gradients():
    out = run_bench(
        "kv_buffer_ab.py",
        *TOY,
        "--against",
        "HEAD",
        "--rounds",
        "2",
        "--variants",
        "full",
        "per-dim",
        "dynamic",
    ).stdout
    rows = [line for line in out.splitlines() if line.split()[:1] in (["full"], ["per-dim"], ["dynamic"])]
    assert len(rows) == 3
    assert all("values bit-identical" in r and "max rel diff 0.0e+00" in r for r in rows)


# --------------------------------------------------------------------------- the thread default


@pytest.mark.parametrize(
    "cores, load, threads",
    [
        (1, 0.0, 1),
        (2, 0.0, 1),
        (3, 0.0, 1),
        (2, 5.0, 1),
        (4, 0.0, 4),
        (4, 0.2, 3),
        (8, 2.5, 5),
        (8, 7.9, 1),
        (8, 30.0, 1),
        (16, 0.0, 16),
    ],
)
def test_default_threads_is_one_on_few_cores_else_the_cores_the_load_leaves_free(cores, load, threads):
    from lime_probe.specs.base import default_threads

    assert default_threads(cores, load) == threads


def run_threads(env_policy: str | None) -> list[str]:
    """``configure_threads(None)`` in a fresh process: [OMP_WAIT_POLICY it leaves, threads in effect]."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if env_policy is not None:
        env["OMP_WAIT_POLICY"] = env_policy
    code = (
        "import os; from lime_probe.specs.base import configure_threads; n = configure_threads(None); "
        "import torch; assert torch.get_num_threads() == n; print(os.environ['OMP_WAIT_POLICY'], n)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


@pytest.mark.slow
def test_configure_threads_waits_passively_unless_told_and_picks_the_default():
    import os

    policy, n = run_threads(None)
    assert policy == "PASSIVE"
    cores = len(os.sched_getaffinity(0))
    assert int(n) == 1 if cores < 4 else 1 <= int(n) <= cores
    assert run_threads("ACTIVE")[0] == "ACTIVE"  # the user's policy stands


@pytest.mark.slow
def test_probe_speed_prints_old_new_and_plain_for_every_command_and_model():
    toy = [
        "--threads",
        "1",
        "--pairs",
        "6",
        "--paradigms",
        "2",
        "--windows",
        "2",
        "--window",
        "600",
    ]  # over extract's 512
    toy += [
        "--documents",
        "12",
        "--rounds",
        "1",
        "--vocab",
        "300",
        "--gpt2-layers",
        "2",
        "--gpt2-hidden",
        "32",
    ]
    toy += ["--gpt2-heads", "2", "--lime-layers", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe_speed.py"), *toy],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={k: v for k, v in __import__("os").environ.items() if k != "LIME_PROBE_DATA"},  # synthetic data
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("LIMe", "GPT-2"))]
    assert [(r[0], r[2]) for r in rows] == [
        (m, c) for m in ("LIMe", "GPT-2") for c in ("blimp", "blimp", "entropy", "separability")
    ]
    assert "(probes" in rows[1]  # the whole command, beside its probes' own time
    assert all(float(r[-1]) > 0 and float(r[-3]) > 0 for r in rows if r[2] != "blimp")  # new x, old x


@pytest.mark.slow
def test_compiled_memory_finds_lime_keeping_its_buffer_beyond_llama():
    """Each LIMe row's difference to LLaMA equals the K/V buffer the script computes from the shapes
    (2 layers, 1 x 16 tokens: a few seconds per traced model on the meta device)."""
    out = run_bench("compiled_memory.py", "--layers", "2", "--batch", "1", "--seq", "16").stdout
    rows = [line.split() for line in out.splitlines() if line.split()[1:2] == ["LIMe"]]
    assert [r[0] for r in rows] == ["gqa", "mha"]
    for row in rows:  # shape, "LIMe", routing, MiB, - LLaMA, buffer, x LLaMA
        assert float(row[4]) == float(row[5]) > 0
    for bad, named in ((["--routings", "nope"], "unknown routing spec 'nope'"), (["--seq", "0"], "--seq")):
        err = run_bench("compiled_memory.py", *bad, ok=False).stderr.strip()
        assert named in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("interpreted", [False, True], ids=["torch", "Triton interpreted"])
def test_routed_backward_times_each_variant_beside_the_readers_and_checks_its_gradients(interpreted, request):
    """bench/routed_backward.py at toy size: every variant's gradients are the baseline's (the readers
    computing their own weight gradients) and each row's ratio lies in its interval; the Triton row
    runs only where the kernel does (here under Triton's interpreter)."""
    if interpreted:
        request.getfixturevalue("triton_interpreter")
    bench = bench_script("routed_backward")
    args = argparse.Namespace(
        layers=4, tokens=8, head_dim=4, rounds=3, device="cpu", dtype="float32", compiled=None
    )
    result = bench.measure(2, args)
    names = ["readers", "source, torch", *(["source, triton"] if interpreted else [])]
    assert [r["variant"] for r in result["rows"]] == names
    assert [s["variant"] for s in result["skipped"]] == ([] if interpreted else ["source, triton"])
    for row in result["rows"]:
        assert row["max_rel_error"] < 1e-5 and row["ms"] > 0
        assert row["ci"][0] <= row["x_readers"] <= row["ci"][1]


def test_routed_backward_compiled_runs_one_fused_pass_per_source_with_the_readers_gradients(monkeypatch):
    """``--compiled``: the reads as a compiled model runs them (the custom operators, through AOT
    autograd's graphs): the source's pass gives the readers' gradients, one call per source layer and
    keys or values, each over its readers in ascending order (one run of them: one launch)."""
    from lime_model import kv_buffer

    bench = bench_script("routed_backward")
    calls = []
    original = kv_buffer.source_backward
    monkeypatch.setattr(kv_buffer, "source_backward", lambda *a: calls.append(a[1]) or original(*a))
    args = argparse.Namespace(
        layers=4, tokens=8, head_dim=4, rounds=1, device="cpu", dtype="float32", compiled="aot_eager"
    )
    rows = {r["variant"]: r for r in bench.measure(2, args)["rows"]}
    assert rows["source, torch"]["max_rel_error"] < 1e-5
    per_step = calls[: 2 * 4]  # the gradient check's step: 4 sources, keys and values
    assert sorted(map(tuple, per_step)) == sorted([tuple(range(j, 4)) for j in range(4)] * 2)


def test_routed_backward_names_a_kernel_that_fell_back_instead_of_timing_the_gemms_as_it(
    monkeypatch, triton_interpreter
):
    """A kernel that fails on the device falls back to the GEMMs (``source_backward``); the bench must then
    say so, not time the GEMMs under the kernel's name."""
    from lime_model import kv_kernels

    monkeypatch.setattr(kv_kernels, "_FAILED", set())

    def broken(*args):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(kv_kernels, "_triton_backward", broken)
    bench = bench_script("routed_backward")
    args = argparse.Namespace(
        layers=3, tokens=8, head_dim=4, rounds=1, device="cpu", dtype="float32", compiled=None
    )
    result = bench.measure(2, args)
    assert [r["variant"] for r in result["rows"]] == ["readers", "source, torch"]
    [skip] = result["skipped"]
    assert skip["variant"] == "source, triton" and "out of resources: shared memory" in skip["why"]


def test_routed_backward_sweep_records_a_failing_setting_and_keeps_the_kernel_on(
    monkeypatch, triton_interpreter
):
    """A tile or warp setting that fails is that setting's result: the others are timed against the shipped
    one, and the kernel stays on for the rest of the process (a ``gpu_check`` run's step rows)."""
    from lime_model import kv_kernels

    monkeypatch.setattr(kv_kernels, "_FAILED", set())
    launch = kv_kernels._launch

    def too_big_for_four_warps(*args, **kwargs):
        if kv_kernels.WARPS == 4:
            raise RuntimeError("out of resources: registers")
        return launch(*args, **kwargs)

    monkeypatch.setattr(kv_kernels, "_launch", too_big_for_four_warps)
    bench = bench_script("routed_backward")
    args = argparse.Namespace(
        layers=3, tokens=8, head_dim=4, rounds=1, device="cpu", dtype="float32", compiled=None
    )
    rows = bench.sweep(2, args)
    assert [(r["tile"], r["block"], r["warps"]) for r in rows] == bench.SWEEP
    for row in rows:
        if row["warps"] == 4:
            assert "error" in row and "out of resources: registers" in row["error"] and "ms" not in row
        else:
            assert row["ms"] > 0 and row["GB_per_s"] > 0 and "error" not in row
    assert rows[0]["x_shipped"] == 1.0
    assert not kv_kernels._FAILED


def test_routed_backward_finds_a_wrong_deferred_gradient(monkeypatch):
    """Its gradient check is a real one: a source's pass that drops its readers' weight gradients shows."""
    from lime_model import kv_kernels

    bench = bench_script("routed_backward")
    original = kv_kernels._torch_backward
    monkeypatch.setattr(kv_kernels, "_torch_backward", lambda *a: (original(*a)[0], original(*a)[1] * 0))
    args = argparse.Namespace(
        layers=3, tokens=8, head_dim=4, rounds=1, device="cpu", dtype="float32", compiled=None
    )
    rows = {r["variant"]: r for r in bench.measure(2, args)["rows"]}
    assert rows["source, torch"]["max_rel_error"] > 0.1


@pytest.mark.slow  # ten compilations for a GPU target
def test_the_kernel_compiles_for_an_h100_without_spilling_registers():
    """bench/kernel_resources.py: every specialization that the 1B shapes launch compiles for sm_90 (no GPU
    needed) and spills nothing to local memory at the shipped settings (a memory-bound kernel that
    spills moves more bytes than it reads)."""
    pytest.importorskip("triton", reason="compiling the kernel needs Triton (the dev extra)")
    out = run_bench("kernel_resources.py").stdout
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gqa"], ["mha"])]
    assert [(r[0], int(r[1])) for r in rows] == [(s, 2**i) for s in ("gqa", "mha") for i in range(5)]
    for _, _, block, registers, spilled, shared in rows:
        assert int(spilled) == 0 and 0 < int(registers) <= 255 and int(block) >= 16 and int(shared) > 0


@pytest.mark.parametrize(
    ("args", "named"),
    [(["--device", "tpu"], "--device"), (["--rounds", "0"], "--rounds"), (["--shapes", "big"], "--shapes")],
)
def test_routed_backward_refuses_bad_arguments_in_one_line(args, named):
    err = run_bench("routed_backward.py", *args, ok=False).stderr.strip()
    assert named in err and len(err.splitlines()) == 1, err


def test_every_bench_script_parses_its_options_with_one_line_errors():
    """Each script's parser is ``OneLineParser`` and its counts are ``POSITIVE_INT``: a bad option is one line
    and exit 2, not a traceback from deep inside torch (a seed, and gpu_check's worker count, may be 0)."""
    import ast

    may_be_zero = {"--seed", "--compile-workers"}
    for path in sorted((ROOT / "bench").glob("*.py")):
        tree = ast.parse(path.read_text())
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            assert ast.unparse(call.func) != "argparse.ArgumentParser", (
                f"{path.name}: argparse.ArgumentParser"
            )
            if getattr(call.func, "attr", None) != "add_argument":
                continue
            kind = next((ast.unparse(k.value) for k in call.keywords if k.arg == "type"), None)
            option = call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) else None
            assert kind != "int" or option in may_be_zero, f"{path.name}: {option} takes any int"


@pytest.mark.parametrize(
    ("script", "args", "named"),
    [
        ("extract_overhead.py", ["--hidden", "32"], "--hidden 32: not a multiple of 64"),
        ("kv_buffer_ab.py", ["--rounds", "-1"], "--rounds"),
    ],
)
def test_bench_scripts_refuse_bad_counts_in_one_line(script, args, named):
    err = run_bench(script, *args, ok=False).stderr.strip()
    assert named in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("routing", "pairs", "sources"),
    [
        ("full", 16 * 15 // 2, 15),  # every earlier layer; the last is read by none other
        ("first-4", (1 + 2 + 3) + 12 * 4, 4),  # layers 1-3 read all before them, the rest layers 0-3
        ("last-4", 1 + 2 + 13 * 3, 15),  # the three before each, where there are three
        ("dilated-8", 8 * 1 + 7 * 2, 2),  # layers 1-8 read layer 0, layers 9-15 layers 0 and 8
        ("none", 0, 0),
    ],
)
def test_routed_floor_counts_each_routings_pairs_in_closed_form(routing, pairs, sources):
    floor = bench_script("routed_floor")
    assert floor.pair_counts(routing, 16) == (pairs, sources)
    assert floor.floor_units(routing, 16) == 2 * (2 * pairs + sources)


def test_routed_floor_prints_each_rows_floor_and_the_share_of_peak_its_target_needs(tmp_path):
    """A JSON with one row: 16 layers, kv 8, 4 x 2048 tokens of head_dim 64 (U = 8 MiB), full routing
    (2 x (2 x 120 + 15) = 510 U), LLaMA at 0.128 s; at 4 TB/s the floor is 510 x 8 MiB / 4e12 B/s =
    1.0695 ms (1.0084x), and the target 1.010 allows 1.28 ms: 83.6 % of the peak, 3.34 TB/s."""
    check = {
        "device_name": "a GPU",
        "settings": {"layers": 16, "hidden": 2048, "heads": 32, "batch": 4, "seq": 2048, "kv": {"gqa": 8}},
        "sections": {
            "step": {"rows": [{"shape": "gqa", "variant": "full", "ratio": 1.05, "llama_step_s": 0.128}]}
        },
    }
    path = tmp_path / "check.json"
    path.write_text(__import__("json").dumps(check))
    out = run_bench("routed_floor.py", path, "--bandwidth", "4").stdout
    row = next(line for line in out.splitlines() if line.startswith("gqa full"))
    assert row.split()[2:5] == ["1.050", "1.07", "1.0084"] and row.endswith("3.34 TB/s (84%)"), row
    err = run_bench("routed_floor.py", path, ok=False).stderr.strip()
    assert (
        "no peak bandwidth known for 'a GPU': give --bandwidth (TB/s)" in err and len(err.splitlines()) == 1
    )
    err = run_bench("routed_floor.py", tmp_path / "missing.json", ok=False).stderr.strip()
    assert "not a GPU check's JSON" in err and len(err.splitlines()) == 1


def test_extract_host_times_both_placements_against_the_baseline():
    out = run_bench(
        "extract_host.py", "--batches", "2", "--windows", "2", "--seq", "16", "--names", "2", "--features", "8",
        "--rounds", "3", "--threads", "1",
    ).stdout  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("2 batches x 2 tensors x 32 x 8 rows (bf16 in")
    assert [line.split(" median")[0].strip() for line in lines[1:]] == [
        "baseline",
        "placed, float32",
        "placed, held",
    ]
    for line in lines[2:]:
        ratio, interval = line.split("/ baseline ")[1].split()[:2]
        low, high = map(float, interval.strip("[]").split("-"))
        assert low <= float(ratio) <= high
