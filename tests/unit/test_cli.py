"""`specfleet generate` end to end in a subprocess on tiny models: JSON output, lossless output; clear errors from the
CLI's own entry point in this process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.cli import run_cli

pytestmark = pytest.mark.heavy  # the fast tier leaves it out: most tests run the CLI in a subprocess (a model load each)


def specfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(tiny_models, tiny_draft_models):
    return tiny_models["qwen2"], tiny_draft_models["qwen2"]


def test_generate_json_is_the_targets_greedy_output(pair, tmp_path):
    target, draft = pair
    prompts = ["The quick brown fox", "def add(a, b):"]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    res = specfleet("generate", "--target", str(target), "--draft", str(draft), "--prompts-file",
                    str(tmp_path / "p.jsonl"), "--max-tokens", "12", "--k", "3", "--no-chat", "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    for r in rows:
        ids = tok.encode(r["prompt"])
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert r["token_ids"] == ref
        assert r["text"] == tok.decode(ref, skip_special_tokens=True)
        assert r["stats"]["proposed"] > 0 and 0 <= r["stats"]["accepted"] <= r["stats"]["proposed"]
        assert r["finish_reason"] in ("length", "stop")


def test_generate_without_draft_and_with_self_draft_agree(pair):
    target, _ = pair
    outs = []
    for extra in (["--draft", "none"], ["--draft-layers", "0,3", "--draft-quantization", "int8"]):
        res = specfleet("generate", "--target", str(target), *extra, "--prompt", "Hello there", "--max-tokens",
                        "10", "--json")
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0


def test_generate_on_weights_quantized_at_load_is_lossless_with_a_quantized_draft(pair):
    """`--weights int4` reaches the loader (a different model than the dense one), and a self-draft re-quantized
    to int4 on top of it leaves the output that of the int4 target alone."""
    target, _ = pair
    outs = []
    for extra in (["--draft", "none"], ["--draft-layers", "0,3", "--draft-quantization", "int4"],
                  ["--draft", "none", "--weights", "dequantized"]):
        res = specfleet("generate", "--target", str(target), "--weights", "int4", *extra, "--prompt", "Hello there",
                        "--max-tokens", "12", "--json")
        assert res.returncode == 0, res.stderr
        outs.append(json.loads(res.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0
    assert outs[0] != outs[2]  # the last flag wins: dense weights, another model


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/nonexistent/model.gguf"], "not found"),
        (["--config", "/nonexistent.yaml"], "no such config file"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--k", "99"], "speculation.k"),
        (["--draft-layers", "0,99"], "layers"),
    ],
)
def test_bad_input_gives_a_clear_message_and_exit_2(pair, args, message, capsys):
    target, _ = pair
    base = ["generate", "--prompt", "hi"] + ([] if "--target" in args or "--config" in args else ["--target", str(target)])
    status, _, err = run_cli(capsys, *base, *args)
    assert status == 2 and message in err, err


def test_empty_prompt_is_refused(pair, capsys):
    status, _, err = run_cli(capsys, "generate", "--target", str(pair[0]), "--prompt", "", "--no-chat")
    assert status == 2 and "prompt is empty" in err


def test_bench_spec_runs_all_modes_and_is_lossless_in_fp32(pair, tmp_path):
    target, draft = pair
    out, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["Name three colours."]}\n{"turns": ["Write a haiku about rain."]}\n')
    res = specfleet("bench", "spec", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                    "--num-prompts", "2",
                    "--max-tokens", "8", "--k", "3", "--dtype", "fp32", "--json", str(out), "--plot", str(tmp_path / "b.png"))
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    modes = report["modes"]
    assert set(modes) == {"a_plain", "b_spec", "b_spec_draft_fp32", "c_hf_assisted"}
    for name, m in modes.items():
        assert m["tokens"] > 0 and m["tok_s"] > 0
        assert m["identical_to_plain"] == 1.0, name  # fp32: every mode gives the target's greedy output
    assert modes["b_spec"]["spec"]["proposed"] > 0
    assert report["ratios"]["b_spec/a_plain"] > 0 and (tmp_path / "b.png").stat().st_size > 0


def test_bench_load_runs_every_policy_at_every_rate_and_is_lossless_in_fp32(pair, tmp_path):
    target, draft = pair
    out, prompts = tmp_path / "load.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["Question {i}: name {i} colours."]}}\n' for i in range(6)))
    res = specfleet("bench", "load", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                    "--rates", "4,16", "--duration", "1", "--max-tokens", "6", "--k", "3", "--dtype", "fp32",
                    "--concurrency", "3", "--json", str(out), "--plot", str(tmp_path / "l.png"))
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert [(r["rate"], r["policy"]) for r in report["runs"]] == [
        (rate, p) for rate in (4.0, 16.0) for p in ("off", "fixed", "goodput")]
    for r in report["runs"]:
        assert r["requests"] > 0 and r["tokens"] == 6 * r["requests"] and r["throughput_tok_s"] > 0
        assert r["p99_latency_s"] >= r["mean_latency_s"] * 0.999 and r["mean_ttft_s"] <= r["mean_latency_s"]
        assert r["identical_to_off"] == 1.0  # fp32: every policy gives the target's greedy output
    assert {r["policy"]: r["mean_k"] for r in report["runs"] if r["rate"] == 4.0}["off"] == 0
    assert {r["policy"]: r["mean_k"] for r in report["runs"] if r["rate"] == 4.0}["fixed"] > 0
    assert len(report["saturation"]) == 6 and "goodput: 3 concurrent / 1, tokens/s" in report["ratios"]
    assert (tmp_path / "l.png").stat().st_size > 0


def test_bench_load_rejects_bad_rates(pair, capsys):
    target, draft = pair
    status, _, err = run_cli(capsys, "bench", "load", "--target", str(target), "--draft", str(draft), "--rates", "fast")
    assert status == 2 and "--rates" in err


def test_bench_default_takes_any_model_and_every_mode_is_lossless_in_fp32(pair, tmp_path):
    target, draft = pair
    out, prompts = tmp_path / "default.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["Question {i}: name {i} colours, then {i} colours again."]}}\n'
                               for i in range(4)))
    res = specfleet("bench", "default", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                    "--num-prompts", "4", "--max-tokens", "8", "--batches", "1", "4", "--repeats", "2",
                    "--dtype", "fp32", "--json", str(out))
    assert res.returncode == 0, res.stderr
    setup = json.loads(out.read_text())["setups"]["custom"]
    assert setup["repeats"] == 2 and set(setup["batches"]) == {"1", "4"}
    for batch, rows in setup["batches"].items():
        modes = {name: r for name, r in rows.items() if not name.startswith("_")}
        assert set(modes) == {"off"} | {f"{kind} {p}" for kind in ("draft model", "ngram", "suffix")
                                        for p in ("fixed", "goodput")}
        for name, r in modes.items():
            assert r["tok_s"] > 0 and r["identical_to_off"] == 1.0, (batch, name)  # fp32: the target's output
            assert r["repeatable"] == 1.0, (batch, name)  # both passes gave the same outputs
            assert len(r["vs_off_by_pass"]) == 2 and all(v > 0 for v in r["vs_off_by_pass"]), (batch, name)
        assert modes["off"]["vs_off_by_pass"] == [1.0, 1.0]  # each pass against off's own, side by side
        assert modes["draft model fixed"]["mean_k"] > 0
        assert set(rows["_goodput_vs_best"]) == {"draft model", "ngram", "suffix"}
    assert setup["off_saturation"]["4"] > 0  # JSON keys are strings


def test_bench_default_continuous_queues_every_prompt_with_its_own_length_and_stays_lossless(pair, tmp_path):
    """`--continuous`: every prompt in one queue at batch 2 (slots refilled as requests end), each with an output
    length drawn from [max_tokens / 4, max_tokens]; every mode gives plain decoding's outputs in fp32."""
    import argparse

    from deploy.bench import default as bench_default

    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["Question {i}: name {i} colours, then {i} colours again."]}}\n'
                               for i in range(6)))
    parser = argparse.ArgumentParser()
    bench_default.add_arguments(parser)
    args = parser.parse_args(["--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                              "--num-prompts", "6", "--max-tokens", "16", "--kinds", "ngram", "--dtype", "fp32",
                              "--continuous"])
    setup = bench_default.setups(args)[0]
    model = bench_default._models(setup, args.dtype, args.device, args.weights)[0]
    ids = [model.encode(p, chat=True) for p in bench_default.load_prompts(args.prompts, 6)]
    modes = bench_default._measure(setup, args, ids, 2, {})
    lengths = [len(o) for o in modes["off"].outputs]
    assert len(lengths) == 6 and all(4 <= n <= 16 for n in lengths) and len(set(lengths)) > 1, lengths
    for name, m in modes.items():
        assert m.outputs == modes["off"].outputs, name


def test_bench_default_wants_a_target_for_its_draft(pair, capsys):
    status, _, err = run_cli(capsys, "bench", "default", "--draft", str(pair[1]))
    assert status != 0 and "--draft needs --target" in err


def test_generate_says_which_path_runs_the_model_and_a_generic_one_is_the_targets_greedy(tiny_generic_models):
    target = tiny_generic_models["gemma2"]
    res = specfleet("generate", "--target", str(target), "--draft-layers", "0,3", "--prompt", "The quick brown fox",
                    "--max-tokens", "12", "--k", "3", "--no-chat", "--json")
    assert res.returncode == 0, res.stderr
    assert "generic path (transformers' gemma2 decoder layers" in res.stderr
    row = json.loads(res.stdout)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = tok.encode(row["prompt"])
    ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
    assert row["token_ids"] == ref and row["stats"]["proposed"] > 0


def test_generate_backend_flag_forces_a_path_or_names_why_not(pair, tiny_generic_models):
    target, _ = pair
    outs = []
    for backend, says in (("native", "native path (forced"), ("generic", "generic path (transformers' qwen2")):
        res = specfleet("generate", "--target", str(target), "--backend", backend, "--draft", "none", "--prompt",
                        "Hello there", "--max-tokens", "10", "--json")
        assert res.returncode == 0 and says in res.stderr, res.stderr
        outs.append(json.loads(res.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) > 0
    res = specfleet("generate", "--target", str(tiny_generic_models["gemma2"]), "--backend", "native", "--prompt", "Hi")
    assert res.returncode != 0 and "'gemma2' has no native path" in res.stderr
    assert len([line for line in res.stderr.splitlines() if "error" in line]) == 1, res.stderr


def test_bench_models_runs_one_model_on_both_paths_and_checks_their_tokens(tiny_generic_models, tmp_path):
    out, prompts = tmp_path / "models.json", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("Tell me about lighthouses.", "def add(a, b):")))
    res = specfleet("bench", "models", "--model", str(tiny_generic_models["qwen3"]), "--prompts", str(prompts),
                    "--num-prompts", "2",
                    "--max-tokens", "6", "--check-tokens", "6", "--dtype", "fp32", "--no-llama", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["check_fp32"]["same_tokens"] == [True, True]
    assert report["plans"]["native"].startswith("native path") and report["plans"]["generic"].startswith("generic path")
    rows = {r["name"]: r for r in report["rows"]}
    assert {"native stored plain", "native dequantized plain", "generic plain", "generic spec (ngram k=4)"} <= set(rows)
    assert all(r["tok_s"] > 0 for r in rows.values()) and rows["generic plain"]["vs_generic_plain"] == 1.0
    assert len(report["load_before"]) == 3 and "native == generic greedy on 2/2 prompts" in res.stdout
