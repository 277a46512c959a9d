"""The 150M protocol's amendment (figures/lime-150m/PROTOCOL.md, "Amendment"): every number it and the
folder README quote recomputed here from the committed CPU tables, the recipe and the dataset's stated
sizes, and its data check (check_data.sh) and run guard run on stand-in files.

Mutations tried, each failing a test here: "power 0.94" -> "power 0.93"; "power 0.22" -> "power 0.24";
"19 seeds" -> "18 seeds"; "SD 8.56" -> "SD 8.65"; "182.94" -> "182.49"; "= 0.77" -> "= 0.78"; "MDE
1.30" -> "MDE 1.3"; "up to an SD of 0.31" -> "0.32"; "0.0327 nats" -> "0.0372 nats"; "+13.72" ->
"+13.27"; "41.9 GB" -> "42 GB"; "1.82 GB" -> "1.8 GB"; "42.5 GB" -> "45.2 GB"; "84.5 GB" -> "84.4 GB";
"101.5 H200-hours" -> "105.1 H200-hours"; "131,072 tokens" -> "131,000 tokens"; "20 evaluations" ->
"21 evaluations"; "about 13.2B" -> "about 12.3B"; `router_lr_mult` 10 -> 1 in the recipe; N_SHARDS=14
-> 13 in check_data.sh; "Holm over these eleven" -> "these ten".
"""

import csv
import hashlib
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

from lime_model.recipes import load_recipe
from lime_probe.probes.stats import paired_t_mde

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "figures" / "lime-150m"
FAIR = ROOT / "figures" / "lm-cpu-fair"
EFFECT, LLAMA_PPL = 0.53, 16.46  # the paper's difference at 150M and LLaMA's perplexity (Table 12)


def flat(path: Path) -> str:
    return " ".join(path.read_text().replace("*", "").split())


@pytest.fixture(scope="module")
def amendment() -> str:
    text = flat(FOLDER / "PROTOCOL.md")
    return text.split("## Amendment, 2026-12-04 (before any run)", 1)[1]


def read_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def power(n: int, sd: float, effect: float, alpha: float = 0.05) -> float:
    """Two-sided paired t-test's power: P(|T| > t crit), T noncentral t with n - 1 df."""
    crit = stats.t.ppf(1 - alpha / 2, n - 1)
    nc = effect * math.sqrt(n) / sd
    return float(stats.nct.sf(crit, n - 1, nc) + stats.nct.cdf(-crit, n - 1, nc))


def test_the_amendment_is_dated_before_any_result(amendment):
    assert "no run of this study had been made" in amendment
    # no result of the study is in its folder yet
    assert not any((FOLDER / name).exists() for name in ("findings.md", "differences.csv", "summary.json"))
    assert "Amended before any run (2026-12-04" in flat(FOLDER / "README.md")


def test_a1_power_and_seeds_recompute_from_the_cpu_study(amendment):
    rows = read_csv(FAIR / "perplexity.csv")
    ppl = {(r["model"], int(r["seed"])): float(r["perplexity"]) for r in rows}
    seeds = sorted(s for m, s in ppl if m == "LIMe")
    d = [ppl["LIMe", s] - ppl["LLaMA", s] for s in seeds]
    sd, llama = statistics.stdev(d), statistics.mean(ppl["LLaMA", s] for s in seeds)
    scaled = sd * LLAMA_PPL / llama
    assert f"(15.93 against {LLAMA_PPL}, Table 12)" in amendment
    assert f"{math.log(LLAMA_PPL / (LLAMA_PPL - EFFECT)):.4f} nats" in amendment
    assert f"SD {sd:.2f} at LLaMA's mean perplexity of {llama:.2f}" in amendment
    assert f"{sd:.2f} x {LLAMA_PPL} / {llama:.2f} = {scaled:.2f}" in amendment
    assert f"with power {power(5, scaled, EFFECT):.2f}" in amendment
    assert f"MDE {paired_t_mde(5, scaled):.2f} at 80 % power" in amendment
    needed = next(n for n in range(2, 100) if power(n, scaled, EFFECT) >= 0.8)
    assert needed == next(n for n in range(2, 100) if paired_t_mde(n, scaled) <= EFFECT)
    assert f"{needed} seeds are needed for 80 % power" in amendment
    assumed = 0.25
    assert f"a paired SD of {assumed} perplexity ({assumed / LLAMA_PPL:.3f} nats" in amendment
    assert f"power {power(5, assumed, EFFECT):.2f} (MDE {paired_t_mde(5, assumed):.2f})" in amendment
    assert (scaled / assumed) == pytest.approx(3, abs=0.2)  # "a third of the CPU's relative spread"
    largest = EFFECT / paired_t_mde(5, 1.0)  # the SD at which 5 seeds have exactly 80 % power
    assert power(5, largest, EFFECT) == pytest.approx(0.8, abs=1e-6)
    assert f"80 % power up to an SD of {math.floor(largest * 100) / 100:.2f}" in amendment
    readme = flat(FOLDER / "README.md")
    assert f"power {power(5, assumed, EFFECT):.2f} for the paper's -0.53" in readme
    assert f"paired SD of {assumed}" in readme and f"and {power(5, scaled, EFFECT):.2f} at the CPU" in readme
    assert f"({scaled:.2f}), where {needed} seeds would be needed" in readme


def test_a2_the_router_multiplier_is_the_cpu_studys_choice(amendment):
    row = next(
        r
        for r in read_csv(FAIR / "differences.csv")
        if (r["model"], r["reference"], r["endpoint"]) == ("LIMe-router-x1", "LIMe", "perplexity")
    )
    mean, low, high = (float(row[k]) for k in ("diff_mean", "ci_low", "ci_high"))
    assert row["verdict"] == "higher" and low > 0 and row["n_seeds"] == "10"
    assert f"+{mean:.2f} perplexity worse than at x10 [+{low:.2f}, +{high:.2f}] over 10 seeds" in amendment
    assert f"x1 was +{mean:.2f} perplexity worse" in flat(FOLDER / "README.md")
    recipe = load_recipe("lime-150m")
    assert recipe.router_lr_mult == 10 and "sets `router_lr_mult` 10" in amendment
    assert (
        f"the router at {recipe.lr * recipe.router_lr_mult:.0e} with the base rate {recipe.lr:.0e}".replace(
            "e-02", "e-2"
        ).replace("e-03", "e-3")
        in amendment
    )
    # the sweep chose x10 at every base rate it tried
    means = {
        r["model"]: float(r["mean"]) for r in read_csv(ROOT / "figures" / "lm-cpu-lr-sweep" / "selection.csv")
    }
    assert all(means[f"LIMe-lr{lr}-r10"] < means[f"LIMe-lr{lr}-r1"] for lr in ("1e-3", "3e-3", "1e-2"))


def test_a3_the_shards_are_named_alike_everywhere(amendment):
    script = (FOLDER / "check_data.sh").read_text()
    n = int(re.search(r"^N_SHARDS=(\d+)$", script, re.M)[1])
    test_shard = re.search(r"^TEST_SHARD=(\S+)$", script, re.M)[1]
    documents = int(re.search(r"^TEST_DOCUMENTS=(\d+)$", script, re.M)[1])
    last = f"train-{n - 1:05d}-of-00234.parquet"
    readme = flat(FOLDER / "README.md")
    for text in (amendment, readme):
        assert f"train-00000-of-00234.parquet` to `{last}`" in text
        assert f"the first {documents:,} documents of `{test_shard}`" in text
    assert f"exactly the {n} parquet shards" in amendment and f"A3: the {n} training shards" in readme
    recipe = load_recipe("lime-150m")
    tokens = recipe.steps * recipe.batch_size * recipe.seq_len
    per_shard = 220 / 234  # the dataset card's 220B tokens over its 234 shards
    assert f"about {per_shard:.2f}B each, so the {n} hold about {n * per_shard:.1f}B" in amendment
    assert f"the {tokens / 1e9:.2f}B the runs read" in amendment
    assert round(n * per_shard / (tokens / 1e9) - 1, 1) == 0.3  # "a quarter more"
    assert test_shard not in [f"train-{i:05d}-of-00234.parquet" for i in range(n)]


def test_a4_disk_and_gpu_time(amendment):
    recipe = load_recipe("lime-150m")
    rows = math.ceil(recipe.steps * recipe.batch_size / (1 - recipe.eval_holdout))  # train.prepare_data's
    tokens = rows * recipe.seq_len
    cache_gb = tokens * 4 / 1e9  # int32
    assert f"{rows:,} x {recipe.seq_len} x 4 bytes = {cache_gb:.1f} GB ({tokens:,} tokens)" in amendment
    readme = flat(FOLDER / "README.md")
    params = float(re.search(r"6ND = 6 x ([\d.]+)M", readme)[1]) * 1e6
    checkpoint = params * 12 / 1e9  # fp32 weights + AdamW's two moments
    per_run = recipe.keep_last * checkpoint + params * 4 / 1e9
    assert f"12 bytes per parameter: {checkpoint:.2f} GB for {params / 1e6:.2f}M parameters" in amendment
    assert f"about {per_run:.2f} GB per run and {10 * per_run:.1f} GB for the ten runs" in amendment
    assert f"About {cache_gb + 10 * per_run:.1f} GB in all" in amendment
    assert f"A4: {cache_gb:.1f} GB of packed tokens and about {10 * per_run:.1f} GB of checkpoints" in readme
    assert f"disk: {cache_gb:.1f} GB for the packed tokens" in readme
    assert f"about {10 * per_run:.1f} GB of checkpoints under `runs/`" in readme
    # the GPU time: the README's estimate recomputed (6ND plus the attention products, at 33 % of an
    # H200's 989 TFLOP/s), and quoted unchanged by the amendment
    hours = 6 * params + 12 * recipe.model["num_hidden_layers"] * recipe.seq_len * recipe.model["hidden_size"]
    hours *= tokens / (0.33 * 989e12) / 3600
    assert f"{hours:.1f} H200-hours per run, {10 * hours:.1f} H200-hours for the 10 runs" in readme
    assert f"about {10 * hours / 8:.1f} hours on 8 H200s" in readme
    assert (
        f"the README's {hours:.1f} H200-hours per run, {10 * hours:.1f} H200-hours for the ten (about "
        f"{10 * hours / 8:.1f} hours on 8 H200s)" in amendment
    )


def test_the_parameter_count_the_costs_use():
    m = load_recipe("lime-150m").model
    d, inter, layers, kv = (
        m["hidden_size"],
        m["intermediate_size"],
        m["num_hidden_layers"],
        m["num_key_value_heads"],
    )
    block = 4 * d * d + 3 * d * inter + 2 * d  # q, k, v, o (full multi-head), the MLP, two norms
    routers = sum(kv * (i + 1) * kv for i in range(1, layers))  # layer i mixes i + 1 layers' heads
    params = m["vocab_size"] * d + d + layers * block + routers  # tied embedding, final norm
    readme = flat(FOLDER / "README.md")
    assert f"6ND = 6 x {params / 1e6:.2f}M" in readme and f"LIMe's routers add {routers:,}" in readme


def test_a5_the_trajectory_is_logged_and_the_mixing_null_guards_the_run(amendment, tmp_path):
    recipe = load_recipe("lime-150m")
    assert f"every {recipe.eval_every:,} steps" in amendment
    assert f"first {recipe.eval_max_rows} packed rows" in amendment
    assert (
        f"{recipe.eval_max_rows * recipe.seq_len:,} tokens), {recipe.steps // recipe.eval_every} evaluations"
        in (amendment)
    )
    assert f"gap at step {recipe.steps:,} minus gap at step {recipe.steps * 3 // 4:,}" in amendment
    script = (FOLDER / "run.sh").read_text()
    assert script.count('--eval-data "$TEST"') == 2  # prepare and train read the same held-out rows
    # the run refuses unless the declaration holds the amendment's two secondaries: it does now
    guard = re.search(r'python -c "\n(.*?)\n"\n', script, re.S)[1]
    n = int(re.search(r"if n != (\d+):", guard)[1])
    assert n == 9 + 2 and "Holm over these eleven" in amendment  # the nine and the two mixing-null rows
    done = subprocess.run([sys.executable, "-c", guard], capture_output=True, text=True, cwd=ROOT)
    assert (done.returncode, done.stderr) == (0, "")
    without = (  # the declaration without the amendment's rows is refused
        "from dataclasses import replace\n"
        "from lime_probe.studies import STUDIES\n"
        "from lime_probe.studies.amendment_150m import amendment_claims\n"
        "from lime_probe.studies.lm_tuned import converged_separability\n"
        "added = amendment_claims(converged_separability(), converged_separability('routed_values'))\n"
        "s = STUDIES['lime-150m']\n"
        "STUDIES['lime-150m'] = replace(s, claims=tuple(c for c in s.claims if c not in added))\n"
    )
    refused = subprocess.run(
        [sys.executable, "-c", without + guard], capture_output=True, text=True, cwd=ROOT
    )
    assert refused.returncode == 2
    assert (
        refused.stderr.strip()
        == f"run.sh: the lime-150m declaration holds 9 secondary endpoints, the protocol {n}"
    )


def stand_in_data(root: Path, n: int = 14) -> Path:
    train = root / "fineweb-edu" / "train"
    train.mkdir(parents=True)
    for i in range(n):
        (train / f"train-{i:05d}-of-00234.parquet").write_bytes(f"shard {i}".encode())
    (root / "fineweb-edu" / "test.jsonl").write_text('{"text": "held out"}\n')
    (root / "blimp").mkdir()
    (root / "blimp" / "causative.jsonl").write_text('{"sentence_good": "a", "sentence_bad": "b"}\n')
    return root


def check(script: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env)


def test_check_data_records_at_the_first_read_and_refuses_a_mismatch(tmp_path):
    script = tmp_path / "study" / "check_data.sh"  # a copy: its data.sha256 is written beside it
    script.parent.mkdir()
    shutil.copy(FOLDER / "check_data.sh", script)
    data = stand_in_data(tmp_path / "DATA")
    first = check(script, str(data))
    assert first.returncode == 0, first.stderr
    manifest = (script.parent / "data.sha256").read_text().splitlines()
    files = sorted(p for p in data.rglob("*") if p.is_file())
    assert sorted(line.split("  ", 1)[1] for line in manifest) == sorted(
        str(p.relative_to(data)) for p in files
    )
    for line in manifest:
        digest, name = line.split("  ", 1)
        assert digest == hashlib.sha256((data / name).read_bytes()).hexdigest()
    assert check(script, str(data)).returncode == 0  # the same files pass
    (data / "fineweb-edu" / "train" / "train-00003-of-00234.parquet").write_bytes(b"another shard")
    refused = check(script, str(data))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "fineweb-edu/train/train-00003-of-00234.parquet differ from" in refused.stderr
    (data / "fineweb-edu" / "train" / "extra.parquet").write_bytes(b"x")
    refused = check(script, str(data))
    assert refused.returncode == 2 and "must hold exactly train-00000-of-00234.parquet to" in refused.stderr


def test_check_data_writes_the_held_out_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shard = tmp_path / "train-00233-of-00234.parquet"
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(5003)]}), shard, row_group_size=1000)
    assert check(FOLDER / "check_data.sh", "--make-test", str(shard), str(tmp_path / "D")).returncode == 0
    lines = (tmp_path / "D" / "fineweb-edu" / "test.jsonl").read_text().splitlines()
    assert lines == [f'{{"text": "document {i}"}}' for i in range(5000)]
    wrong = tmp_path / "train-00000-of-00234.parquet"
    shutil.copy(shard, wrong)
    refused = check(FOLDER / "check_data.sh", "--make-test", str(wrong), str(tmp_path / "E"))
    assert refused.returncode == 2 and "come from train-00233-of-00234.parquet" in refused.stderr
    assert not (tmp_path / "E").exists()
