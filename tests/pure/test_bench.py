"""L0: the benchmark scripts' pure parts (row names, log parsing, result summaries, tables); their
smoke runs on the CPU: tests/multi_process/test_bench_smoke.py."""
from __future__ import annotations

import argparse

import pytest

from tests.helpers.bench import load_bench


bench = load_bench("offload_bench")
single = load_bench("single_gpu_baseline")


@pytest.mark.parametrize("name, want", [
    ("pcie48-prefetch", ("pcie", 48, "prefetch", False, None, None, None)),
    ("pcie48-resident-noclip/s16", ("pcie", 48, "resident", True, 16, None, None)),
    ("nvlink24-fsdp2@llama-2-13b", ("nvlink", 24, "fsdp2", False, None, None, "llama-2-13b")),
    ("pcie48-prefetch/s16", ("pcie", 48, "prefetch", False, 16, None, None)),
    ("pcie24-hybrid-noclip/s16", ("pcie", 24, "hybrid", True, 16, None, None)),
    ("pcie48-actoff/s16", ("pcie", 48, "actoff", False, 16, None, None)),
    ("pcie48-prefetch+cross@llama-2-13b", ("pcie", 48, "prefetch", False, None, "cross", "llama-2-13b")),
    ("pcie24-noprefetch/s16+sequential@tiny", ("pcie", 24, "noprefetch", False, 16, "sequential", "tiny")),
])
def test_parse_row_good(name, want):
    assert tuple(bench.parse_row(name)) == (*want, False, ())


def test_parse_row_eager():
    row = bench.parse_row("pcie48-hybrid-noclip-eager/s16@llama-3b")
    assert tuple(row) == ("pcie", 48, "hybrid", True, 16, None, "llama-3b", True, ())


def test_parse_row_flags():
    """``~<flag>=<value>`` suffixes, in order, after the model (or alone)."""
    row = bench.parse_row("pcie48-hybrid/s13@llama-3b~fuse_last_stage=false~keep_layers=-1")
    assert row.model == "llama-3b" and row.flags == (("fuse_last_stage", "false"), ("keep_layers", "-1"))
    assert bench.parse_row("pcie48-actoff~partition=layers").flags == (("partition", "layers"),)


@pytest.mark.parametrize("name", [
    "pcie48", "pcie-prefetch", "pci48-prefetch", "pcie48-prefetch+auto", "pcie48-prefetch@llama-2-7b+cross",
    "pcie48-prefetch+cross/s16", "pcie48-prefetch/s0", "pcie48-prefetch/16", "pcie48-fsdp2/s16",
    "pcie48-fsdp2+cross", "pcie48-fsdp2-noclip", "pcie48-fsdp2-eager", "pcie48-prefetch-eager-noclip", "pcie48-prefetch/s16-noclip", "pcie48-prefetch@", "pcie48-prefetch@a/b", "pcie48-prefetch ",
    "pcie48-fsdp2~keep_layers=1", "pcie48-prefetch~keep_layers", "pcie48-prefetch~Keep=1", "pcie48-prefetch~a=b,c",
    "pcie48-prefetch~a=1@llama-3b",
])
def test_parse_row_bad(name, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_row(name)
    assert str(e.value).startswith("error: bad row name") and "\n" not in str(e.value)


def test_slug():
    assert bench.slug("pcie48-prefetch/s16+cross@llama-2-13b") == "pcie48-prefetch_s16+cross@llama-2-13b"


def test_parse_log():
    log = ("[rank0] mapping cross: stage -> rank [0, 2, 1, 3, 0, 2, 1, 3] (position p on rank [0, 2, 1, 3][p]; roots "
           "of the ranks' GPUs [0, 0, 1, 1] from nvidia-smi); predicted step 5.1s, round_robin 5.6s (+8.9% saved), "
           "worst 6s (position p on rank [0, 1, 2, 3][p])\nstep 1/3 loss 10.4\n"
           "timeline: measured step 1.2340s, cost model (measured op durations) 1.1110s, prediction error -10.0%; "
           "wrote a, b, c\n")
    got = bench.parse_log(log)
    assert got["mapping_line"].startswith("mapping cross: stage -> rank [0, 2, 1, 3")
    assert (got["measured_timeline_step_s"], got["predicted_step_s"], got["prediction_error_pct"]) == \
        (1.234, 1.111, -10.0)
    short = bench.short_mapping(got["mapping_line"])
    assert short == ("mapping cross: stage -> rank [0, 2, 1, 3, 0, 2, 1, 3]; "
                     "predicted step 5.1s, round_robin 5.6s (+8.9% saved)")
    seq = bench.parse_log("mapping sequential: stage s on rank s % 4 (asked for; planner not run)\n"
                          "timeline: measured step 2.0000s, cost model 2.5000s, prediction error +25.0%")
    assert bench.short_mapping(seq["mapping_line"]) == "mapping sequential: stage s on rank s % 4"
    assert seq["prediction_error_pct"] == 25.0
    assert bench.parse_log("nothing here") == {"mapping_line": None, "measured_timeline_step_s": None,
                                               "predicted_step_s": None, "prediction_error_pct": None,
                                               "resident_stages": None, "kept_layers": None}
    chosen = bench.parse_log("offload: 3 of 8 stages per GPU stay resident, AdamW state included: ...\n"
                             "recompute: 4 of 32 decoder layers keep their activations, per stage [0, 2, 2] (auto)")
    assert bench.describe({**chosen, "mode": "hybrid"}) == "3/8 stages resident, 4/32 layers kept"
    assert bench.describe({"resident_stages": "0/8", "kept_layers": "0/32"}) == ""
    hybrid = bench.parse_log("offload: 1 of 4 stages per GPU stay resident, AdamW state included: each rank's "
                             "first 1 (auto: estimated peak 30.12 GiB within 80% of 48.00 GiB)")
    assert hybrid["resident_stages"] == "1/4"


def _iteration(time_s: float, breakdown: bool) -> dict:
    rank = {"h2d_bytes": 4e9, "h2d_seconds": 0.1, "d2h_bytes": 2e9, "d2h_seconds": 0.1,
            "peak_reserved_bytes": 2**31, "host_rss_bytes": 2**30}
    per_rank = []
    for r in range(2):
        extra = {"compute_seconds": 1.0 + r, "load_wait_seconds": 0.5, "offload_wait_seconds": 0.25,
                 "optimizer_wait_seconds": 0.125} if breakdown else {}
        per_rank.append({**rank, **extra})
    return {"time_s": time_s, "tokens_per_s": 1000.0, "tflops_per_gpu": 50.0, "loss": 10.0,
            "peak_mem_bytes": [2**30, 2**31], "per_rank": per_rank}


@pytest.mark.parametrize("breakdown", [True, False])
def test_summarise_and_tables(breakdown):
    res = {"iterations": [_iteration(9.0, breakdown), _iteration(4.0, breakdown), _iteration(6.0, breakdown)]}
    row = bench.summarise(res, "prefetch", argparse.Namespace(warmup=1))
    assert row["step_time_s"] == 5.0 and row["peak_allocated_gb"] == 2.0 and row["host_rss_gb"] == 2.0
    assert row["h2d_gbps"] == pytest.approx(40.0) and row["d2h_gbps"] == pytest.approx(20.0)
    if breakdown:  # rank means: compute (1 + 2) / 2
        assert (row["compute_s"], row["load_wait_s"], row["offload_wait_s"], row["optimizer_wait_s"]) == \
            (1.5, 0.5, 0.25, 0.125)
        assert row["other_s"] == pytest.approx(5.0 - 2.375)
    else:
        assert row["compute_s"] == row["load_wait_s"] == 0 and row["other_s"] == 5.0
    rows = [{"row": "pcie48-prefetch+cross", **row, **bench.parse_log("timeline: measured step 4.0000s, cost model "
                                                                      "(x) 3.0000s, prediction error -25.0%")},
            {"row": "pcie48-fsdp2", "status": "ok", "step_time_s": 7.0, "tokens_per_s": 1.0, "tflops_per_gpu": 1.0,
             "peak_allocated_gb": 1.0, "peak_reserved_gb": 1.0, "host_rss_gb": None},
            {"row": "pcie48-resident/s16+sequential", "status": "not run (budget)"},
            {**row, "row": "pcie48-hybrid", "mode": "hybrid", "resident_stages": "1/4"}]
    main = bench.table(rows).splitlines()
    assert "| step s | compute s | load wait s | offload wait s | optim wait s | other s |" in main[0]
    assert all(line.count("|") == main[0].count("|") for line in main)
    assert main[2].startswith("| pcie48-prefetch+cross | ok | 5.00 | ")
    assert main[3].startswith("| pcie48-fsdp2 | ok | 7.00 | - | - | - | - | - |")
    assert main[5].startswith("| pcie48-hybrid (1/4 stages resident) | ok | 5.00 | ")
    mapping = bench.mapping_table(rows).splitlines()
    assert len(mapping) == 4 and all(line.count("|") == 7 for line in mapping)
    assert mapping[2] == "| pcie48-prefetch+cross | 5.00 | - | 4.000 | 3.000 | -25.0 |"
    assert mapping[3].startswith("| pcie48-resident/s16+sequential | - | - |")
    assert bench.mapping_table(rows[1:2]) == ""


def test_single_gpu_next_layers():
    assert single.next_layers(0, 33, 7) == 7
    assert single.next_layers(7, 33, 8) == 8
    assert single.next_layers(7, 33, None) == 20
    assert single.next_layers(7, 9, 12) == 8


@pytest.mark.parametrize("fits_up_to, want_tries", [(6, [5, 6, 8, 7]), (5, [5, 6]), (0, [5, 4, 2, 1]),
                                                    (32, [5, 6, 8, 12, 20, 26, 29, 31, 32])])
def test_single_gpu_search(monkeypatch, fits_up_to, want_tries):
    monkeypatch.setattr(single, "spawn_try", lambda args, n, timeout: {"layers": n, "ok": n <= fits_up_to,
                                                                        "error": None if n <= fits_up_to else "OOM"})
    summary = single.search(single.parse_args(["--model", "llama-2-7b"]))
    assert [t["layers"] for t in summary["tries"]] == want_tries
    assert summary["largest_layers"] == fits_up_to and summary["complete"]
    assert summary["reference_params"] == {"llama-2-7b": 6738415616, "llama-2-13b": 13015864320}
    if fits_up_to:
        assert summary["ratio_13b_to_largest"] == pytest.approx(13015864320 / summary["largest_params"])
    else:
        assert summary["largest_params"] is None and summary["ratio_13b_to_largest"] is None


def test_single_gpu_search_stops_on_a_crash(monkeypatch):
    """A try that fails for another reason than running out of memory says nothing about fitting."""
    monkeypatch.setattr(single, "spawn_try", lambda args, n, timeout: {"layers": n, "ok": False, "error": "rc 1: boom"})
    summary = single.search(single.parse_args(["--model", "llama-2-7b"]))
    assert len(summary["tries"]) == 1 and not summary["complete"] and summary["largest_params"] is None


def test_failure_status():
    assert bench.failure("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate", 1) == "OOM"
    assert bench.failure("error: this configuration does not fit: it needs about 69.78 GiB on GPU rank 1", 1) \
        == "OOM (plan, before start)"
    assert bench.failure("RuntimeError: NCCL timeout", 1) == "failed (rc 1)"


# --- peers: sweep bookkeeping, best-of-sweep selection and the table, on fake result files ---

sweep = load_bench("sweep")
peers = load_bench("peers")
fsdp2 = load_bench("fsdp2_baseline")
rp = load_bench("roundpipe_baseline")
ds = load_bench("deepspeed_baseline")

N7B = 6_738_415_616


def _pt(system, step_times, status="ok", exact=True, **cfg):
    return sweep.point(system, cfg, exact, status=status, warmup_s=[9.0], step_times_s=step_times,
                       num_params=N7B, tokens_per_step=32768, num_gpus=2, peak_allocated_gib=30.0)


def test_sweep_point_rates_and_budget_decisions():
    p = _pt("deepspeed", [4.0, 6.0], micro_batch_per_rank=32)
    assert p["step_time_s"] == 5.0 and p["tokens_per_s"] == 32768 / 5.0
    assert p["tflops_per_gpu"] == pytest.approx(6 * N7B * 32768 / 5.0 / 2 / 1e12)
    assert _pt("deepspeed", [], status="pruned")["step_time_s"] is None
    assert sweep.fits(100, 200, 100) and not sweep.fits(100, 200, 101) and sweep.fits(1e9, None, 1e9)
    assert sweep.should_prune(16.0, 10.0, 1.5) and not sweep.should_prune(15.0, 10.0, 1.5)
    assert not sweep.should_prune(99.0, None, 1.5) and not sweep.should_prune(99.0, 1.0, 0)
    assert sweep.parse_int_list("32,16, 8") == [32, 16, 8]
    for bad in ("", "0", "a,1"):
        with pytest.raises(SystemExit):
            sweep.parse_int_list(bad)


def test_best_by_system_ignores_unmeasured_points():
    points = [_pt("roundpipe-async", [3.0], num_microbatch=8), _pt("roundpipe-sync", [5.0], num_microbatch=8),
              _pt("roundpipe-async", [2.5], num_microbatch=4), _pt("roundpipe-sync", [], status="OOM"),
              _pt("roundpipe-async", [], status="pruned"), _pt("roundpipe-sync", [1.0], status="failed: x")]
    best = sweep.best_by_system(points)
    assert best["roundpipe-async"]["config"] == {"num_microbatch": 4}
    assert best["roundpipe-sync"]["step_time_s"] == 5.0
    assert sweep.best_step(points, "fsdp2") is None


def test_fsdp2_sweep_points():
    assert fsdp2.sweep_points([32, 16, 8], ["deferred", "each"], 32) == \
        [(32, "single"), (16, "deferred"), (16, "each"), (8, "deferred"), (8, "each")]
    assert fsdp2.sweep_points([4, 4], ["each"], 32) == [(4, "each")]
    with pytest.raises(ValueError, match="do not divide the 32"):
        fsdp2.sweep_points([32, 12], ["each"], 32)
    with pytest.raises(ValueError, match="unknown"):
        fsdp2.sweep_points([8], ["never"], 32)
    assert ds.accum_steps(64, 2, 8) == 4
    with pytest.raises(ValueError):
        ds.accum_steps(64, 2, 12)


def test_roundpipe_points_and_keyword_adapter():
    assert rp.parse_points("async:8,sync:4x2") == [("async", 8, 1), ("sync", 4, 2)]
    for bad in ("async:0", "lazy:8", "sync:8x", "async8"):
        with pytest.raises(SystemExit):
            rp.parse_points(bad)

    def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None):
        return (config, inputs_embeds, attention_mask, past_key_values, position_ids)

    adapted = rp.keyword_adapter(create_causal_mask, {"input_embeds": "inputs_embeds"})
    # transformers 4's keywords, as RoundPipe 0.1.1's Llama preset passes them
    assert adapted(config="c", input_embeds="e", attention_mask=None, cache_position="dropped",
                   past_key_values=None, position_ids="p") == ("c", "e", None, None, "p")
    assert rp.keyword_adapter(lambda **kw: kw, {"input_embeds": "inputs_embeds"})(input_embeds=1) == {"input_embeds": 1}


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep.write_json(path, obj)


def test_peers_table_from_result_files(tmp_path):
    header = {"num_params": N7B, "tokens_per_step": 32768, "num_gpus": 2}
    _write(tmp_path / "peers" / "fsdp2.json", sweep.result({**header, "system": "fsdp2"}, [
        _pt("fsdp2", [12.0], micro_batch_per_rank=32, grad_sync="single"),
        _pt("fsdp2", [10.0], micro_batch_per_rank=16, grad_sync="deferred", num_micro_batches=2),
        _pt("fsdp2", [], status="pruned", micro_batch_per_rank=4, grad_sync="each")]))
    rp_points = [_pt("roundpipe-async", [3.0], exact=False, num_microbatch=8),
                 _pt("roundpipe-async", [2.0], exact=False, num_microbatch=4),
                 _pt("roundpipe-sync", [], status="OOM", exact=True, num_microbatch=8)]
    _write(tmp_path / "peers" / "roundpipe.json", {**header, "system": "roundpipe", "points": rp_points})  # no "best"
    _write(tmp_path / "bench" / "rows.json", {"rows": [
        {"row": "pcie48-hybrid/s16", "model": "llama-2-7b", "status": "ok", "step_time_s": 2.75, "compute_s": 2.24,
         "load_wait_s": 0.01, "offload_wait_s": 0.01, "optimizer_wait_s": 0.17, "other_s": 0.32,
         "peak_allocated_gb": 34.0, "tokens_per_s": 11926.0, "resident_stages": "3/8"},
        {"row": "pcie48-prefetch", "status": "not run (budget)"}]})
    runs = {"deepspeed": {"peer": "deepspeed", "status": "failed (rc 1)"}}
    rows = peers.collect(tmp_path, tmp_path / "bench", ["fsdp2", "deepspeed", "roundpipe"], runs, 2, 32768)
    assert [r["system"] for r in rows] == ["mmoc-pipe pcie48-hybrid/s16", "mmoc-pipe pcie48-prefetch", "fsdp2",
                                           "deepspeed", "roundpipe-async", "roundpipe-sync"]
    fs = rows[2]
    assert fs["step_time_s"] == 10.0 and fs["points"] == 3
    assert fs["config"] == "micro_batch_per_rank=16, grad_sync=deferred"
    assert rows[4]["step_time_s"] == 2.0 and rows[4]["exact"] is False
    assert rows[0]["tflops_per_gpu"] == pytest.approx(6 * N7B * 32768 / 2.75 / 2 / 1e12)
    lines = peers.table(rows).splitlines()
    assert lines[0].startswith("| system | best config | s/step | peak GPU GiB | exact? | tokens/s | model TFLOP/s/GPU |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2].startswith("| mmoc-pipe pcie48-hybrid/s16 | 3/8 stages resident | 2.75 | 34.0 | yes | 11926 | ")
    assert lines[2].endswith("| 2.24 | 0.01 | 0.01 | 0.17 | 0.32 |")
    assert lines[3].startswith("| mmoc-pipe pcie48-prefetch | not run (budget) |")
    assert lines[4].startswith("| fsdp2 | micro_batch_per_rank=16, grad_sync=deferred | 10.00 | 30.0 | yes | 3277 | ")
    assert lines[4].endswith("| - | - | - | - | - |")
    assert lines[5].startswith("| deepspeed | no result (failed (rc 1)) |")
    assert lines[6].startswith("| roundpipe-async | num_microbatch=4 | 2.00 | 30.0 | no | ")
    assert lines[7].startswith("| roundpipe-sync | no point measured (OOM) |")


def test_peers_partial_run_and_budgets(tmp_path):
    res = sweep.result({"num_params": N7B, "tokens_per_step": 32768, "num_gpus": 2},
                       [_pt("deepspeed", [5.0], micro_batch_per_rank=32, gradient_accumulation_steps=1)])
    rows = peers.peer_rows("deepspeed", res, {"status": "killed (budget)"})
    assert rows[0]["config"] == "micro_batch_per_rank=32, gradient_accumulation_steps=1 (run killed (budget))"
    assert peers.peer_rows("roundpipe", None, None) == [{"system": "roundpipe", "status": "not run"}]
    assert peers.parse_budgets("roundpipe=400")["roundpipe"] == 400 and peers.parse_budgets("")["fsdp2"] == 150
    with pytest.raises(SystemExit):
        peers.parse_budgets("megatron=1")
    peers_args = peers.parse_args(["--fsdp_micro_batches", "32,16", "--deepspeed_micro_batches", "32",
                                   "--roundpipe_points", "async:8", "--grad_clip", "0.0"])
    assert peers_args.peers == ["fsdp2", "deepspeed", "roundpipe"]
    cmd, env = peers.peer_command("roundpipe", peers_args, tmp_path / "rp.json", 300)
    assert "torch.distributed.run" not in cmd and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert cmd[cmd.index("--grad_clip") + 1] == "0.0"  # the no-clipping form reaches the peer
    assert not any(a.startswith("--lora") for a in cmd)  # full fine-tuning: the scripts' default
    cmd, env = peers.peer_command("deepspeed", peers_args, tmp_path / "ds.json", 300)
    assert "--nproc_per_node=2" in cmd and env["NCCL_P2P_DISABLE"] == "1" and int(env["OMP_NUM_THREADS"]) >= 1


LORA_JOB = ["--gpus", "1", "--cap_gb", "24", "--model", "llama-3-8b", "--lora_rank", "16", "--lora_alpha", "32",
            "--lora_target_modules", "all-linear"]


def _script_args(cmd):
    """The flags after the peer script's path in a peer's command line."""
    script = next(i for i, a in enumerate(cmd) if a.endswith("_baseline.py"))
    return cmd[script + 1:]


def test_peers_pass_lora_to_fsdp2_and_roundpipe(tmp_path):
    """One peers.py command with --lora_rank: the LoRA peers by default, each command line carrying
    the job's LoRA, and each script's own parser reading it back."""
    args = peers.parse_args(LORA_JOB + ["--fsdp_sync_modes", "deferred"])
    assert args.peers == ["fsdp2", "roundpipe"]
    for peer, script in (("fsdp2", fsdp2), ("roundpipe", rp)):
        cmd, _ = peers.peer_command(peer, args, tmp_path / f"{peer}.json", 300)
        got = script.parse_args(_script_args(cmd))
        assert (got.lora_rank, got.lora_alpha, got.lora_target_modules) == (16, 32.0, "all-linear"), peer
        assert (got.model, got.mem_cap_gb, got.batch_size) == ("llama-3-8b", 24.0, 64)
    cmd, _ = peers.peer_command("fsdp2", args, tmp_path / "f.json", 300)
    assert fsdp2.parse_args(_script_args(cmd)).sync_modes == "deferred" and "--nproc_per_node=1" in cmd
    cmd, _ = peers.peer_command("roundpipe", peers.parse_args(LORA_JOB[:-1] + ["q_proj,v_proj"]), tmp_path / "r.json",
                                300)
    assert rp.parse_args(_script_args(cmd)).lora_target_modules == "q_proj,v_proj"


@pytest.mark.parametrize("argv, says", [
    (LORA_JOB + ["--peers", "fsdp2,deepspeed"], "has no LoRA switch"),  # it would train the whole model
    (["--peers", "megatron"], "unknown peer"),
    (LORA_JOB[:-1] + ["all-linear,q_proj"], "all-linear alone"),
    (LORA_JOB[:-1] + ["q_proj,lm_head"], "stay frozen"),
    (["--lora_rank", "-1"], "must be >= 0"),
])
def test_peers_refuse_a_lora_job_they_cannot_run(argv, says):
    with pytest.raises(SystemExit, match=says):
        peers.parse_args(argv)


def test_fsdp2_llama_3_8b_preset_matches_the_project_preset():
    """The FSDP2 peer's llama-3-8b is this project's (same shapes, so the same N in every row)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(fsdp2.llama_config("llama-3-8b")).parameters())
    assert n == sweep.model_params("llama-3-8b")


def _results_json(path, step_times, model="llama-3-8b"):
    its = [{"step": i, "step_time_s": t, "tokens_per_s": 32768 / t, "tflops_per_gpu": 1.0, "loss": 11.0,
            "peak_mem_bytes": [20 * 2**30], "per_rank": [{"compute_seconds": t - 0.5, "load_wait_seconds": 0.1,
                                                         "host_rss_bytes": 2**30}]} for i, t in enumerate(step_times)]
    _write(path, {"config": {"model": model, "lora_rank": 16}, "world_size": 1, "iterations": its})


def test_peers_table_takes_a_row_run_by_main_py(tmp_path):
    """--ours_results: a row this project ran through main.py (lora_rows.sh) heads the table, its
    warm-up iterations left out; a missing file is a line that says so."""
    _results_json(tmp_path / "8b" / "results.json", [30.0, 9.0, 4.0, 5.0, 6.0])
    header = {"num_params": 8_030_261_248, "tokens_per_step": 32768, "num_gpus": 1}
    _write(tmp_path / "peers" / "fsdp2.json", sweep.result({**header, "system": "fsdp2"}, [
        sweep.point("fsdp2", {"micro_batch_per_rank": 16, "grad_sync": "deferred", "lora_rank": 16}, True,
                    warmup_s=[9.0], step_times_s=[8.0], num_params=8_030_261_248, tokens_per_step=32768,
                    num_gpus=1)]))
    specs = [f"lora-8b={tmp_path / '8b' / 'results.json'}", f"gone={tmp_path / 'none.json'}"]
    rows = peers.collect(tmp_path, tmp_path / "bench", ["fsdp2"], {}, 1, 32768, specs)
    assert [r["system"] for r in rows] == ["mmoc-pipe lora-8b", "mmoc-pipe gone", "fsdp2"]
    assert rows[0]["step_time_s"] == pytest.approx(5.0) and rows[0]["compute_s"] == pytest.approx(4.5)
    # LoRA: 4 FLOPs a parameter and token (no frozen weight's gradient), for every system
    assert rows[0]["tflops_per_gpu"] == pytest.approx(4 * sweep.model_params("llama-3-8b") * 32768 / 5.0 / 1e12)
    assert rows[2]["tflops_per_gpu"] == pytest.approx(4 * 8_030_261_248 * 32768 / 8.0 / 1e12)
    assert rows[1]["status"].startswith("no result")
    assert rows[2]["config"] == "micro_batch_per_rank=16, grad_sync=deferred, lora_rank=16"
    with pytest.raises(SystemExit, match="NAME=PATH"):
        peers.results_row("results.json")


def test_steps_measure_after_warmup_and_stop_early():
    steps = sweep.Steps(warmup=2, iterations=3, best_s=None, prune_factor=1.5, budget_s=None, started_at=0.0)
    assert steps.add(0, 9.0, 1.0, now=1.0) is None and steps.add(1, 2.0, 1.0, now=2.0) is None
    assert steps.add(2, 1.9, 0.5, now=3.0) is None
    assert (steps.warm, steps.times, steps.losses) == ([9.0, 2.0], [1.9], [0.5])
    slower = sweep.Steps(warmup=1, iterations=3, best_s=1.0, prune_factor=1.5, budget_s=None, started_at=0.0)
    assert slower.add(0, 1.6, 1.0, now=1.0) == "pruned" and slower.times == []
    late = sweep.Steps(warmup=1, iterations=3, best_s=None, prune_factor=1.5, budget_s=10.0, started_at=0.0)
    assert late.add(0, 3.0, 1.0, now=2.0) == "not run (budget)"  # 2 s + 3 x 3 s > 10 s


def test_peer_run_status_tells_the_budget_from_other_kills():
    assert peers.run_status(0, False) == "ok"
    assert peers.run_status(-9, True) == "killed (budget)"
    assert peers.run_status(-9, False) == "killed by signal 9"  # e.g. the OOM killer, inside the budget
    assert peers.run_status(1, False) == "failed (rc 1)"


# --- bench/long_rows.py ------------------------------------------------------------------------------
def test_long_rows_names_budgets_and_table():
    lr = load_bench("long_rows")
    assert lr.parse_row("ours@131072") == ("ours", 131072, None)
    assert lr.parse_row("ours@32768/seg8") == ("ours", 32768, "seg8")
    for bad in ("roundpipe@65536/seg4", "ours@64k", "deepspeed@16384"):
        with pytest.raises(SystemExit):
            lr.parse_row(bad)
    assert all(lr.parse_row(r) for r in lr.DEFAULT_ROWS.split(","))
    # a row's estimate: start-up and every step; longer rows measure one step after the warm-up
    assert lr.iterations(16384) == (1, 2) and lr.iterations(131072) == (1, 1)
    assert lr.estimate_s("ours", 131072, False) == lr.START_S["ours"] + 2 * lr.STEP_S["ours"][131072]
    assert lr.estimate_s("ours", 262144, False) > lr.estimate_s("ours", 131072, False)
    args = argparse.Namespace(smoke=False, model="llama-3b", cap_gb=24.0)
    flags = lr.our_flags(args, 65536, "seg8")
    assert flags[flags.index("--seq_chunks") + 1] == "8" and flags[flags.index("--num_stages") + 1] == "-1"
    assert lr.our_flags(args, 65536, None)[lr.our_flags(args, 65536, None).index("--seq_chunks") + 1] == "-1"
    assert lr.status_of(-9, "...\n[killed: past its time limit of 90s]\n") == "killed (time limit)"
    assert lr.status_of(2, "error: rank 0 ran out of GPU memory in action 3B0") == "OOM"
    rows = [{"row": "ours@131072", "status": "ok", "step_time_s": 50.0, "tokens_per_s": 2621.4, "tflops": 200.0,
             "peak_gib": 21.0, "plan_gib": 20.0, "num_stages": 26, "seq_chunks": 1, "tiled_mlp": "true",
             "compute_s": 45.0, "load_wait_s": 1.0, "offload_wait_s": 2.0, "optimizer_wait_s": 1.5},
            {"row": "fsdp2@65536", "status": "OOM"}]
    text = lr.table(rows)
    assert "| ours@131072 | ok | 50.00 | 2621 | 200.0 | 21.00 | 20.00 | +5.0% | stages 26, seq_chunks 1, tiled true" in text
    assert "| fsdp2@65536 | OOM | - |" in text


def test_profile_step_sorts_kernels_by_kind_and_counts_idle_once():
    """The profile's kinds from real CUDA kernel names, and idle time from the union of kernels on
    several streams (two overlapping kernels are not idle twice, nor counted as one)."""
    prof = load_bench("profile_step")
    names = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
        "Memcpy HtoD (Pinned -> Device)": "copies",
        "void at::native::(anonymous namespace)::fused_adamw_kernel<float>": "optimizer",
        "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>": "optimizer",
        "triton_per_fused__to_copy_mean_pow_rsqrt_0": "copies",  # a cast first: the first match wins
        "triton_red_fused_rms_norm_backward_1": "norm/rotary/activation",
        "void at::native::vectorized_elementwise_kernel<4, silu_kernel_cuda>": "norm/rotary/activation",
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<c10::BFloat16>>": "elementwise",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication",
        "void cub::DeviceSegmentedRadixSortKernel<Policy900>": "other",
    }
    assert {n: prof.kind_of(n) for n in names} == names
    assert prof.covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]) == pytest.approx(4.0)
    kinds = prof.breakdown([("nvjet_gemm", 0.0, 1.0), ("flash_fwd_kernel", 0.5, 1.5), ("fused_adamw", 2.0, 2.5)], 4.0)
    assert kinds == pytest.approx({"matmul": 1.0, "attention": 1.0, "optimizer": 0.5, "idle": 2.0})
    text = prof.table({"step_s": 4.0, "kinds": kinds, "floor_s": 1.0, "matmul_tflops": 700.0})
    assert text.splitlines()[2].startswith("| idle | 2.000 | 50.0% |")
    assert "| floor: model FLOPs at 700 TFLOP/s | 1.000 | 25.0% |" in text


def test_memory_at_peak_replays_the_highest_point():
    """The allocations alive at the peak, not at the end: a block freed after the peak is in, one
    freed before it is out; a block counts as freed when its free is requested (as
    memory_allocated counts it), not when the streams that used it are done with it. The
    trainer's own lines name a group, not the tests', bench's or an installed library's."""
    peak_mod = load_bench("memory_at_peak")
    root = peak_mod.ROOT
    here = str(root / "pipeline" / "stage" / "layer.py")
    frames = [{"filename": "/lib/torch/functional.py", "line": 1, "name": "linear"},
              {"filename": here, "line": 7, "name": "forward"}]
    installed = [{"filename": str(root / ".whl-site" / "x.py"), "line": 3, "name": "lib"},
                 {"filename": str(root / "tests" / "t.py"), "line": 5, "name": "test"}]
    events = [dict(action="alloc", addr=1, size=4, frames=frames),
              dict(action="alloc", addr=2, size=8, frames=frames[1:]),
              dict(action="alloc", addr=3, size=16, frames=installed),
              dict(action="free_requested", addr=1, size=4),
              dict(action="alloc", addr=5, size=2, frames=frames),
              dict(action="free_completed", addr=1, size=4),
              dict(action="free_requested", addr=3, size=16)]
    peak, at, live = peak_mod.replay(events + [dict(action="alloc", addr=4, size=18, frames=[])])
    assert (peak, at, sorted(live)) == (28, 2, [1, 2, 3])
    got = {k: (size, blocks) for k, size, blocks in peak_mod.groups(live)}
    assert got == {"pipeline/stage/layer.py:7 forward <- linear": (4, [4]),
                   "pipeline/stage/layer.py:7 forward": (8, [8]), "x.py lib": (16, [16])}
    peak, at, live = peak_mod.replay(events + [dict(action="alloc", addr=4, size=19, frames=[])])
    assert (peak, at, sorted(live)) == (29, 7, [2, 4, 5])  # 1 and 3 were freed before it


def test_gpu_test_parts_balance_and_read_back():
    """bench/gpu_tests.py: the parts are balanced by expected seconds and keep pytest's order; a
    verbose log cut before its summary still gives each finished test's outcome, and a finished
    one its durations."""
    import gpu_tests

    ids = [f"tests/gpu/t.py::test_{c}" for c in "abcde"]
    seconds = {ids[0]: 100.0, ids[1]: 60.0, ids[2]: 50.0, ids[3]: 10.0}
    parts = gpu_tests.split(ids, seconds, 2, unknown_s=5.0)
    assert sorted(n for part in parts for n in part) == ids
    assert [round(sum(seconds.get(n, 5.0) for n in part)) for part in parts] == [115, 110]
    assert all(part == sorted(part) for part in parts)
    cut = f"{ids[0]} PASSED [ 50%]\n{ids[1]} FAILED [100%]\n{ids[2]} "
    assert gpu_tests.OUTCOME_RE.findall(cut) == ["PASSED", "FAILED"]
    table = f"12.50s call     {ids[0]}\n0.50s setup    {ids[0]}\n3.00s call     {ids[1]}\n"
    assert gpu_tests.measured(table) == {ids[0]: 13.0, ids[1]: 3.0}


def test_gpu_tests_skip_the_node_ids_a_file_lists(tmp_path):
    """``--skip``: a list of node ids or an earlier call's verbose log names the tests to leave out;
    the log's other lines name none."""
    import gpu_tests

    log = tmp_path / "pytest.txt"
    log.write_text("collected 3 items\n\ntests/gpu/t.py::test_a PASSED [ 50%]\n"
                   "tests/gpu/t.py::test_b[x-1] FAILED [100%]\n\n=== 1 failed in 3s (a::b) ===\n")
    listing = tmp_path / "passed.txt"
    listing.write_text("tests/gpu/t.py::test_c\n")
    assert gpu_tests.listed([str(log), str(listing)]) == {
        "tests/gpu/t.py::test_a", "tests/gpu/t.py::test_b[x-1]", "tests/gpu/t.py::test_c"}


def test_gpu_test_failures_are_written_as_they_happen(tmp_path, monkeypatch):
    """bench/gpu_tests.py as a pytest plugin: a failed test's report goes to its file at once (a
    part cut by its limit never prints pytest's summary); a passed one writes nothing."""
    from types import SimpleNamespace

    import gpu_tests

    log = tmp_path / "failures.txt"
    monkeypatch.setenv("GPU_TESTS_FAILURES", str(log))
    gpu_tests.pytest_runtest_logreport(SimpleNamespace(failed=False, nodeid="t.py::test_ok", when="call"))
    assert not log.exists()
    report = SimpleNamespace(failed=True, nodeid="t.py::test_bad", when="call", longreprtext="E   assert 1 == 2")
    gpu_tests.pytest_runtest_logreport(report)
    assert log.read_text() == "t.py::test_bad (call)\nE   assert 1 == 2\n\n"
