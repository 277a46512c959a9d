"""``bench/gpu_check.py --dry-run``: the sections run at toy size on the CPU and write one JSON, rewritten
after each section (a run killed part-way keeps what finished), with ``--sections`` and ``--rows``
selecting parts; the numbers are what each section says they are."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import bench_script, built_models

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_check():
    return bench_script("gpu_check")


def check_parity(body):
    parity = {r["model"]: r for r in body["rows"]}
    assert set(parity) == {"LIMe", "LLaMA"}
    for r in parity.values():
        errors = [r["logits_rel_error"], r["grad_rel_error_median"], r["grad_rel_error_max"]]
        assert all(math.isfinite(e) and 0 <= e < 0.1 for e in errors)  # bf16 rounds at 2^-9: small
        assert r["grad_rel_error_median"] <= r["grad_rel_error_max"]
        assert r["loss_abs_error"] < 0.05 * r["loss_fp32"]
    assert parity["LIMe"]["router_grad_rel_error_max"] is not None
    assert parity["LLaMA"]["router_grad_rel_error_max"] is None


def check_generate(body):
    # fp32, greedy: the cached K/V reproduce the uncached forward's tokens and scores
    assert body["tokens_equal"] is True and body["first_difference"] is None
    assert body["score_rel_error_max"] < 1e-5
    assert body["cached_tokens_per_s"] > 0 and body["uncached_tokens_per_s"] > 0


def check_extraction(body):
    assert body["tokens"] > 0 and body["rounds"] >= 2
    assert body["ci"][0] <= body["extract_over_plain_time"] <= body["ci"][1]
    assert body["plain_forward_tokens_per_s"] > 0 and body["extract_tokens_per_s"] > 0
    assert body["host_waits"] == {"plain": None, "extract": None}  # counted on a GPU only
    if "extract_serial_over_plain_time" in body:
        low, high = body["extract_serial_ci"]
        assert 0 < low <= body["extract_serial_over_plain_time"] <= high
        profile = body["host_profile"]  # the host's own time by function, largest first
        own = [row["seconds"] for row in profile["top"]]
        assert own == sorted(own, reverse=True) and 0 < sum(own) <= profile["seconds"]
        assert all(re.fullmatch(r".+:\d+\(.+\)", row["function"]) for row in profile["top"])


def check_memory_row(row, cuda: bool):
    assert row["planned_bytes"] == row["planned_tensor_bytes"] + sum(row["allocator"].values()) > 0
    assert bool(row["allocator"]) == cuda  # the CUDA allocator's terms: a GPU plan's only
    assert row["measured_over_planned"] == row["measured_bytes"] / row["planned_bytes"]
    assert len(row["losses"]) == 2 and all(math.isfinite(x) for x in row["losses"])


def test_sections_rewrite_the_json_and_a_kill_keeps_those_that_finished(gpu_check, tmp_path, monkeypatch):
    out = tmp_path / "check.json"

    def killed(ctx):
        assert json.loads(out.read_text())["running"] == "probes"  # written before the section
        raise KeyboardInterrupt  # as a kill: no section after it runs, nothing more is written

    monkeypatch.setitem(gpu_check.SECTIONS, "probes", (killed, 30))
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run(True, out, ["parity", "generate", "probes"])
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["settings"]["device"] == "cpu"
    # the CPU sums a source's readers' gradients with torch's GEMMs (no interpreter here)
    assert result["routed_backward"] == "torch" and "triton" in result["versions"]
    # the sections run in SECTIONS' order (timed ones first), not the order asked for
    assert result["running"] == "probes" and list(result["sections"]) == ["generate"]
    assert result["selected"] == {"sections": ["generate", "probes", "parity"], "rows": None}
    assert result["not_selected"] == ["kernel", "extract", "fsdp", "memory", "step"]
    for name, body in result["sections"].items():
        assert body["budget_s"] == gpu_check.SECTIONS[name][1] and body["seconds"] > 0
    check_generate(result["sections"]["generate"])
    assert not list(tmp_path.glob(".*"))  # the atomic writes left no temporary file


def test_a_failing_section_is_recorded_and_the_next_one_runs(gpu_check, tmp_path, monkeypatch):
    def broken(ctx):
        raise ValueError("no such kernel")

    monkeypatch.setitem(gpu_check.SECTIONS, "generate", (broken, 25))
    result = gpu_check.run(True, tmp_path / "check.json", ["generate", "extract"])
    assert result["sections"]["generate"]["error"] == "ValueError: no such kernel"
    check_extraction(result["sections"]["extract"])
    assert "extract_serial_over_plain_time" in result["sections"]["extract"]
    assert result["sections"]["extract"]["model_dtype"] == result["settings"]["dtype"]
    # the rows held in the model's dtype (bf16 where this CPU runs it)
    assert result["sections"]["extract"]["held_dtypes"] == [f"torch.{result['settings']['dtype']}"]
    assert "running" not in result and json.loads((tmp_path / "check.json").read_text()) == result


def test_rows_and_budgets_select_and_skip_memory_rows(gpu_check, tmp_path):
    result = gpu_check.run(True, tmp_path / "a.json", ["memory"], frozenset({"mha:none", "gqa:first-4"}))
    (row,) = result["sections"]["memory"]["rows"]  # gqa:first-4 is a step row
    assert (row["recipe"], row["model"]) == ("lime-1b-mha", "LLaMA")
    check_memory_row(row, cuda=False)
    spent = gpu_check.run(True, tmp_path / "b.json", ["memory"], budgets={"memory": 0})["sections"]["memory"]
    assert spent["rows"] == []
    assert spent["skipped"] == [
        {"row": f"{shape}:{routing}", "why": "the section's budget of 0 s was spent"}
        for shape in ("gqa", "mha")
        for routing in ("full", "none")
    ]


def test_a_memory_row_starts_with_no_earlier_model_alive(gpu_check, monkeypatch):
    """Trained under mixed precision (as on the GPU), a row's model outlives its row in a reference cycle
    (accelerate sets an autocast wrapper of its forward on the model itself); the next row collects it
    before building its own, or the earlier model's parameters would count in that row's peak."""

    def none_alive(refs):
        assert [ref() for ref in refs] == [None] * len(refs), "an earlier row's model is still alive"

    sections, s = bench_script("gpu_sections"), gpu_check.settings(True)
    with built_models(monkeypatch, before_each=none_alive) as built:
        for routing in ("full", "none"):
            recipe = sections.recipe_for(s, "gqa", routing, True, mixed_precision="bf16")
            assert sections.measured_step(recipe, "cpu")["allocated_before"] is None  # CPU: RSS, no allocator
        assert built[0]() is None and len(built) == 2


def test_no_section_leaves_its_models_alive(gpu_check, tmp_path, monkeypatch):
    """A traced model sits in nnsight's reference cycle (the extraction section's); the run collects after
    each section, so the next section (the step timings) does not share the device with it."""
    with built_models(monkeypatch) as built:
        assert "error" not in gpu_check.run(True, tmp_path / "x.json", ["extract"])["sections"]["extract"]
        assert built and [ref() for ref in built] == [None] * len(built)


def test_a_profiled_step_lists_its_kernels_by_self_time(gpu_check):
    """`top_kernels` on the CPU (operators): descending self times that sum to at most the step's total,
    and LIMe's routed read among LIMe's operators only."""
    gpu_step = bench_script("gpu_step")
    args = gpu_step.step_args(gpu_check.settings(True), "gqa")
    args.compile = False  # eager: the read is the custom autograd function, named in the profile
    profiles = {r: gpu_step.top_kernels(gpu_step.Steps(r, args), "cpu", top=40) for r in ("none", "full")}
    for p in profiles.values():
        ms = [k["ms"] for k in p["top"]]
        assert 0 < len(ms) <= 40 and ms == sorted(ms, reverse=True) and min(ms) > 0
        assert sum(ms) <= p["total_ms"] * (1 + 1e-9) and all(k["calls"] >= 1 for k in p["top"])
    names = {r: {k["name"] for k in p["top"]} for r, p in profiles.items()}
    assert "_RoutedRead" in names["full"] and "_RoutedRead" not in names["none"]
    assert profiles["full"]["routed_read_ms"] == 0  # eager: not the compiled read's operators


def test_a_profiled_compiled_step_times_the_routed_read_operators(gpu_check):
    """Compiled (Dynamo's ``eager`` backend, as the dry run compiles): LIMe's step spends part of its time
    in the read's operators, LLaMA's none."""
    gpu_step = bench_script("gpu_step")
    args = gpu_step.step_args(gpu_check.settings(True), "gqa")
    profiles = {r: gpu_step.top_kernels(gpu_step.Steps(r, args), "cpu") for r in ("none", "full")}
    assert profiles["none"]["routed_read_ms"] == 0
    assert 0 < profiles["full"]["routed_read_ms"] < profiles["full"]["total_ms"]


def test_step_models_in_the_order_the_section_compiles_them(gpu_check):
    models = gpu_check.step_models(None)
    assert models[:4] == ["gqa:none", "gqa:full", "mha:none", "mha:full"]  # Table 17's headline rows first
    assert len(models) == len(set(models)) == 2 * (1 + 4)  # each LLaMA once, then every variant
    assert gpu_check.step_models(frozenset({"mha:last-4"})) == ["mha:none", "mha:last-4"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sections", "step", "nope"], "unknown section nope; valid: kernel, generate, extract"),
        (["--rows", "gqa:full", "gqa:half"], "unknown row gqa:half; valid: gqa:none, gqa:full"),
        (["--compile-workers", "-1"], "--compile-workers must be 0 or more, got -1"),
        (["--out", "/nonexistent/folder/x.json"], "--out /nonexistent/folder/x.json: no folder"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(gpu_check, args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "x.json"), *args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_dry_run_runs_every_section_with_a_compile_worker(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--compile-workers", "1"]
    done = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = done.stdout.splitlines()[1:10]  # the sections and their budgets, printed first
    names = ["kernel", "generate", "extract", "fsdp", "memory", "probes", "parity", "step"]
    assert [line.split()[0] for line in plan] == [*names, "total"]
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert list(sections) == names and "running" not in result
    assert result["routed_backward"] == result["routed_backward_at_end"] == "torch"  # the CPU's GEMMs
    for body in sections.values():
        assert "error" not in body and 0 < body["seconds"] <= result["seconds"]
    # what is timed or weighed runs alone; the worker starts with the first section it may run beside
    alongside = {name for name, body in sections.items() if "compile_workers_alongside" in body}
    assert alongside == {"parity", "step"}
    check_parity(sections["parity"])
    kernel = sections["kernel"]  # the CPU: torch's GEMMs beside the readers' own weight gradients
    assert [row["shape"] for row in kernel["rows"]] == ["gqa", "mha"] and kernel["sweep"] == []
    assert [row["shape"] for row in kernel["compiled_rows"]] == ["gqa", "mha"]
    for row in kernel["rows"] + kernel["compiled_rows"]:
        assert [r["variant"] for r in row["result"]["rows"]] == ["readers", "source, torch"]
        assert all(r["max_rel_error"] < 1e-2 for r in row["result"]["rows"])  # bf16 on the CPU
    assert [s["row"] for s in kernel["skipped"]] == ["gqa:sweep", "mha:sweep"]
    check_generate(sections["generate"])
    check_extraction(sections["extract"])
    check_extraction(sections["probes"])
    assert len(sections["probes"]["blimp_probe_accuracy"]) == sections["probes"]["layers"]
    assert sections["probes"]["entropy_device"] == "cpu" and sections["probes"]["entropy_tokens_per_s"] > 0

    fsdp = sections["fsdp"]  # one process: the sharded step's loss is the unsharded model's
    assert fsdp["sharded"] is True and fsdp["loss_vs_unsharded"] == 0
    assert fsdp["planned_bytes"] > 0
    memory = sections["memory"]
    assert {(r["recipe"], r["model"]) for r in memory["rows"]} == {
        (f"lime-1b-{s}", m) for s in ("gqa", "mha") for m in ("LIMe", "LLaMA")
    }
    for row in memory["rows"]:
        check_memory_row(row, cuda=False)

    step = sections["step"]
    assert step["skipped"] == [] and step["compile_workers_alongside"] == 1
    rows = {(r["shape"], r["variant"]): r for r in step["rows"]}
    assert set(rows) == {(s, v) for s in ("gqa", "mha") for v in ("full", "first-4", "last-4", "dilated-8")}
    for r in rows.values():
        assert r["step_s"] > 0 and r["llama_step_s"] > 0
        assert r["ci"][0] <= r["ratio"] <= r["ci"][1]
        # the rows with a target get twice the rounds
        assert r["rounds"] == (
            4 if (r["shape"], r["variant"]) in {("gqa", "full"), ("mha", "full"), ("gqa", "first-4")} else 2
        )
        # the step's own peak memory is the GPU allocator's: not measured on the CPU
        assert r["step_peak_bytes"] == {"llama": None, "variant": None} and r["step_peak_ratio"] is None
        # the full rows profile one step of each model
        assert set(r.get("profile", {})) == ({"llama", "full"} if r["variant"] == "full" else set())
    # each of the ten models compiled once ahead of its row (by the worker, or by the run while it waited)
    # or first by its row itself (None); each shape's LLaMA once, for every row of that shape
    ahead = {(r["shape"], m): a for r in rows.values() for m, a in r["compile"]["ahead"].items()}
    assert len(ahead) == 10 and {m for _, m in ahead} == {"none", "full", "first-4", "last-4", "dilated-8"}
    for record in filter(None, ahead.values()):
        assert re.fullmatch(r"run|worker \d+", record["by"]) and record["seconds"] > 0
    assert step["compile_workers_paused_s"] > 0  # while the rows were timed
    # and the run ends with its targets' table (bench/gpu_targets.py)
    assert "| every Table 17 row measured in one run | 8 of 8 | met |" in done.stdout.splitlines()


def test_memory_rows_subtract_the_previous_rows_parameters():
    """bench/memory_rows.py: each row beside the plan, with the fp32 parameter bytes of the row before it
    (counted here on a model built on the CPU) and the two ratios from them."""
    import torch
    from transformers import AutoModelForCausalLM

    from lime_model.plan import stand_in_tokenizer
    from lime_model.train import model_config

    rows_script, sections = bench_script("memory_rows"), bench_script("gpu_sections")
    gpu_check = bench_script("gpu_check")
    s = gpu_check.settings(True)
    recipe = sections.recipe_for(s, "gqa", "full", True)
    lime = AutoModelForCausalLM.from_config(model_config(recipe, stand_in_tokenizer(recipe)))
    lime_bytes = 4 * sum(p.numel() for p in lime.parameters())
    assert all(p.dtype == torch.float32 for p in lime.parameters())
    measured = [10**8, 2 * 10**8]
    result = {
        "dry_run": True,
        "sections": {
            "memory": {
                "rows": [
                    {"recipe": "lime-1b-gqa", "model": "LIMe", "measured_bytes": measured[0]},
                    {
                        "recipe": "lime-1b-gqa",
                        "model": "LLaMA",
                        "measured_bytes": measured[1],
                        "allocated_before": 7,
                    },
                ]
            }
        },
    }
    first, second = rows_script.rows_against_plan(result)
    assert first["previous_parameters"] == 0 and second["previous_parameters"] == lime_bytes
    assert (first["allocated_before"], second["allocated_before"]) == (None, 7)
    for row, m in zip((first, second), measured, strict=True):
        assert row["plan"] > 0 and row["over_plan"] == m / row["plan"]
        assert row["without_previous_over_plan"] == (m - row["previous_parameters"]) / row["plan"]


def test_the_overlaps_baseline_collects_each_batch_before_the_next_starts(monkeypatch):
    """`collected_at_once`: every batch's rows are collected before the next batch's trace (where
    `extract` itself collects a batch after starting the next), with the same rows."""
    from helpers import tiny_model, tiny_tokenizer

    from lime_probe.extraction import forward, tracing
    from lime_probe.extraction.tracing import extract

    sections = bench_script("gpu_sections")
    tok = tiny_tokenizer()
    model = tiny_model("llama", tok)
    texts = ["the cat is on the mat", "they were here", "it is", "we are all there now"] * 2
    events: list[str] = []
    trace, result = tracing.trace_batch, forward.TracedBatch.result
    monkeypatch.setattr(tracing, "trace_batch", lambda *a, **k: events.append("start") or trace(*a, **k))
    monkeypatch.setattr(forward.TracedBatch, "result", lambda self: events.append("result") or result(self))
    with sections.collected_at_once():
        serial = extract(model, tok, texts, sites=["hidden"], batch_size=2, progress=False)
    assert events == ["start", "result"] * 4
    events.clear()
    overlapped = extract(model, tok, texts, sites=["hidden"], batch_size=2, progress=False)
    assert events == ["start", "start", "result", "start", "result", "start", "result", "result"]
    for layer in serial.layers("hidden"):
        assert torch.equal(serial["hidden"][layer], overlapped["hidden"][layer])


def _state(pid: int) -> str:
    """A process's state letter (/proc/PID/stat): T when stopped."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _states_once(pids: list[int], wanted, within: float = 10.0) -> list[str]:
    """The processes' states once each is ``wanted`` (a signal lands in its own time), or after ``within`` s."""
    give_up = time.perf_counter() + within
    while not all(wanted(_state(p)) for p in pids) and time.perf_counter() < give_up:
        time.sleep(0.01)
    return [_state(p) for p in pids]


def test_paused_workers_and_their_subprocesses_stop_while_a_row_is_timed(gpu_check, monkeypatch, tmp_path):
    """Each worker runs in its own process group: ``paused`` stops it and the subprocesses its compiles
    start (Inductor's), continues them after, and ``stop`` ends them even while stopped."""
    child_pid = tmp_path / "child"
    script = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(child_pid)!r}, 'w').write(str(c.pid)); time.sleep(60)"
    )
    monkeypatch.setattr(
        gpu_check.CompileWorkers, "command", staticmethod(lambda *a: [sys.executable, "-c", script])
    )
    warm = gpu_check.CompileWorkers(["gqa:none"], 1, tiny=True)
    try:
        give_up = time.perf_counter() + 60
        while not (child_pid.exists() and child_pid.read_text()) and time.perf_counter() < give_up:
            time.sleep(0.05)
        pids = [warm.procs[0].pid, int(child_pid.read_text())]
        with warm.paused():
            time.sleep(0.2)
            assert _states_once(pids, lambda state: state == "T") == ["T", "T"]
        assert "T" not in _states_once(pids, lambda state: state != "T") and warm.paused_s >= 0.2
        with warm.paused():
            warm.stop()
        assert warm.alive() == 0 and warm.procs[0].returncode == -signal.SIGTERM
    finally:
        warm.stop()


def test_a_model_is_compiled_by_whoever_claims_it_first(gpu_check, tmp_path):
    """A worker skips what the run (or another worker) claimed, and writes a record of each model it did."""
    gpu_step = bench_script("gpu_step")
    queue = gpu_step.CompileQueue(tmp_path, ("gqa:none", "gqa:full", "gqa:last-4"))
    assert queue.claim("gqa:full") and not queue.claim("gqa:full")
    gpu_step.warm_models(gpu_check.settings(True), list(queue.models), tmp_path)
    assert queue.record("gqa:full") is None  # claimed here, so not compiled by the worker
    for model in ("gqa:none", "gqa:last-4"):
        record = queue.record(model)
        assert record["by"] == f"worker {os.getpid()}" and record["seconds"] > 0
        assert "error" not in record
    assert queue.claim_next() is None


def test_the_run_compiles_later_models_while_it_waits_for_a_workers(gpu_check, tmp_path):
    """``compiled_ahead``: a model no one claimed is the row's own to compile (None); one a worker claimed
    is waited for, and meanwhile the run compiles the next unclaimed model itself."""
    gpu_step, sections = bench_script("gpu_step"), bench_script("gpu_sections")
    queue = gpu_step.CompileQueue(tmp_path, ("gqa:none", "gqa:full", "gqa:last-4"))
    worker = types.SimpleNamespace(queue=queue, alive=lambda: 1)
    ctx = sections.Context(gpu_check.settings(True), time.perf_counter() + 600, "spent", warm=worker)
    assert queue.claim("gqa:full")  # a worker's, which writes its record once the run has helped
    done = {"seconds": 1.0, "by": "worker 7"}

    def finish_when_helped() -> None:
        give_up = time.perf_counter() + 60  # a run that does not help fails below, not hangs
        while queue.record("gqa:last-4") is None and time.perf_counter() < give_up:
            time.sleep(0.05)
        queue._path("gqa:full", "json").write_text(json.dumps(done))

    thread = threading.Thread(target=finish_when_helped)
    thread.start()
    assert gpu_step.compiled_ahead(ctx, "gqa:none") is None  # unclaimed: the run took it
    assert gpu_step.compiled_ahead(ctx, "gqa:full") == done
    thread.join()
    assert queue.record("gqa:last-4")["by"] == "run"
    # past its deadline less HELP_S the run waits without starting a compile, and gives up at the deadline
    queue2 = gpu_step.CompileQueue(tmp_path / "b", ("gqa:none", "gqa:full"))
    queue2.folder.mkdir()
    assert queue2.claim("gqa:none")
    worker.queue = queue2
    ctx.deadline = time.perf_counter() + 1.0
    assert gpu_step.compiled_ahead(ctx, "gqa:none") is None and queue2.record("gqa:full") is None


def test_the_step_section_saves_each_row_and_no_row_starts_past_the_runs_budget(
    gpu_check, tmp_path, monkeypatch
):
    gpu_step = bench_script("gpu_step")
    out, timed_row = tmp_path / "check.json", gpu_step.timed_row
    calls = []

    def killed_on_the_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill during the second row
        return timed_row(*args, **kwargs)

    monkeypatch.setattr(gpu_step, "timed_row", killed_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run(True, out, ["step"], frozenset({"gqa:full", "mha:full"}), workers=0)
    result = json.loads(out.read_text())
    assert result["running"] == "step"
    assert [(r["shape"], r["variant"]) for r in result["sections"]["step"]["rows"]] == [("gqa", "full")]
    monkeypatch.undo()
    spent = gpu_check.run(True, out, ["step"], frozenset({"gqa:full"}), workers=0, run_budget=0)
    assert spent["sections"]["step"]["skipped"] == [
        {"row": "gqa:full", "why": "the run's budget of 0 s was spent"}
    ]


@pytest.mark.parametrize(("gib", "workers"), [(79.18, 2), (139.8, 3), (40, 0), (300, 3)])
def test_as_many_compile_workers_as_the_gpus_memory_holds(gpu_check, monkeypatch, gib, workers):
    props = types.SimpleNamespace(total_memory=int(gib * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    s = {**gpu_check.settings(True), "tiny": False}
    assert gpu_check.default_workers(s) == workers
    assert gpu_check.default_workers(gpu_check.settings(True)) == 0  # the dry run compiles alone


def test_a_compile_worker_dies_with_the_run_even_while_stopped(tmp_path):
    """A worker runs in its own session (``paused`` stops its group), out of reach of a kill of the run's
    group, as a timeout's: the kernel kills it when the run dies, stopped or not."""
    ready = tmp_path / "ready"
    worker = (
        "import os, sys, time; sys.path.insert(0, 'bench'); import gpu_check; "
        f"gpu_check.die_with_parent(os.getppid()); open({str(ready)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    run = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", run], cwd=ROOT)
    try:
        give_up = time.perf_counter() + 60
        while not (ready.exists() and ready.read_text()) and time.perf_counter() < give_up:
            time.sleep(0.1)
        pid = int(ready.read_text())
        os.kill(pid, signal.SIGSTOP)
        assert _states_once([pid], lambda state: state == "T") == ["T"]
    finally:
        parent.kill()
        parent.wait()
    give_up = time.perf_counter() + 10
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.perf_counter() < give_up:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def test_extraction_rounds_stop_at_the_deadline_after_the_third(gpu_check):
    sections = bench_script("gpu_sections")
    s = gpu_check.settings(True)
    tok = sections.tiny_tokenizer()
    hf = sections.build(s, "full", vocab=len(tok)).eval()
    late, *_ = sections.extract_vs_plain(hf, tok, s, rounds=5, deadline=0.0)
    assert late["rounds"] == sections.MIN_ROUNDS == 3 and late["coverage"] == 0.75
    timely, *_ = sections.extract_vs_plain(hf, tok, s, rounds=5)
    assert timely["rounds"] == 5 and timely["ci"][0] <= timely["extract_over_plain_time"] <= timely["ci"][1]
