"""lm-evaluation-harness on ARMOR models, offline: a tiny local multiple-choice task (``harness_tasks/``)
scored by the harness and, independently, by our own log-likelihoods of the same items."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, ArmorTensor, PruneOptions, evaluate, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.cli.parser import HARNESS_JSON, REPORT_JSON, main
from torch_armor.errors import ArmorInputError

TASKS = Path(__file__).resolve().parent / "harness_tasks"
sys.path.insert(0, str(TASKS))
import tiny_mc  # noqa: E402  (the task's own loader: the items as the harness reads them)

pytest.importorskip("lm_eval", reason="pip install 'torch_armor[eval]'")


@pytest.fixture(scope="module")
def armor_llama(smollm2_tokenizer):
    """A tiny random Llama with SmolLM2's vocabulary, ARMOR-pruned (random calibration ids)."""
    model = make_tiny_llama(vocab=len(smollm2_tokenizer))
    ids = torch.randint(0, len(smollm2_tokenizer), (4, 32), generator=torch.Generator().manual_seed(0))
    prune_model(model, ids, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2), refine=None, reconstruct=None),
                options=PruneOptions(progress=False))
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, ArmorTensor)
    return model, smollm2_tokenizer


def own_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context): the continuation's tokens are those that ``context +
    continuation`` has beyond the tokens of ``context`` alone."""
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    assert whole[:len(ctx)] == ctx
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([whole])).logits[0].double()
    logp = F.log_softmax(logits, dim=-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def own_scores(model, tokenizer):
    """acc and acc_norm (log-likelihood per character of the choice) of tiny_mc, and every choice's score."""
    acc = acc_norm = 0
    scores = []
    for item in tiny_mc.items():
        context = f"Question: {item['question']}\nAnswer:"
        ll = [own_loglikelihood(model, tokenizer, context, " " + c) for c in item["choices"]]
        norm = [v / len(c) for v, c in zip(ll, item["choices"])]
        acc += max(range(len(ll)), key=ll.__getitem__) == item["label"]
        acc_norm += max(range(len(norm)), key=norm.__getitem__) == item["label"]
        scores.append(ll)
    n = len(scores)
    return acc / n, acc_norm / n, scores


def test_harness_accuracy_matches_own_loglikelihoods(armor_llama, one_thread):
    model, tokenizer = armor_llama
    results = evaluate(model, tokenizer, ["tiny_mc"], include_path=TASKS, log_samples=True, bootstrap_iters=0)
    acc, acc_norm, scores = own_scores(model, tokenizer)
    got = results["results"]["tiny_mc"]
    assert got["sample_len"] == len(scores) == 12
    assert got["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert got["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
    samples = sorted(results["samples"]["tiny_mc"], key=lambda s: s["doc_id"])
    for sample, own in zip(samples, scores):
        harness = [resp[0] for resp in sample["filtered_resps"]]
        assert harness == pytest.approx(own, abs=1e-3)
    # the items tell the choices apart: a test where every answer were equally likely could not fail
    assert len({round(v, 3) for ll in scores for v in ll}) > 30


def test_evaluate_errors(armor_llama, monkeypatch):
    model, tokenizer = armor_llama
    with pytest.raises(ArmorInputError, match="knows no task no_such_task.*include_path="):
        evaluate(model, tokenizer, "tiny_mc,no_such_task", include_path=TASKS)
    with pytest.raises(ArmorInputError, match="names no task"):
        evaluate(model, tokenizer, " , ")
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-evaluation-harness were not installed
    with pytest.raises(ArmorInputError, match=r"not installed .*pip install 'torch_armor\[eval\]'"):
        evaluate(model, tokenizer, ["tiny_mc"], include_path=TASKS)


@pytest.fixture(scope="module")
def pruned_dir(tmp_path_factory, smollm2_tokenizer):
    """``torch-armor prune`` of a tiny random Llama directory (ARMOR, a few calibration windows)."""
    folder = tmp_path_factory.mktemp("harness_cli")
    make_tiny_llama(vocab=len(smollm2_tokenizer)).save_pretrained(str(folder / "dense"))
    smollm2_tokenizer.save_pretrained(str(folder / "dense"))
    calib = folder / "calib.txt"
    calib.write_text(" ".join(f"{item['question']} {' '.join(item['choices'])}." for item in tiny_mc.items()) * 20)
    out = folder / "armor"
    assert main(["prune", str(folder / "dense"), "--out", str(out), "--calib", str(calib), "--n-calib", "4",
                 "--seq-len", "32", "--iters", "2", "--refine", "none", "--reconstruct-steps", "0",
                 "--no-progress"]) == 0
    assert (out / REPORT_JSON).is_file()
    return out


def test_cli_eval_tasks_prints_the_harness_table_and_writes_json_beside_the_report(pruned_dir, capsys, one_thread):
    code = main(["eval", str(pruned_dir), "--tasks", "tiny_mc", "--include-path", str(TASKS), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    saved = json.loads((pruned_dir / HARNESS_JSON).read_text())
    acc = saved["results"]["tiny_mc"]["acc,none"]
    row = [line for line in out.splitlines() if line.startswith("|tiny_mc")]
    assert len(row) == 1 and "|acc " in row[0] and f"|{acc:.4f}|" in row[0], out
    assert f"results written to {pruned_dir / HARNESS_JSON}" in out

    # the same accuracy from the model as from_pretrained loads it, scored by our own log-likelihoods
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(pruned_dir).eval()
    assert isinstance(model.model.layers[1].self_attn.o_proj.weight, ArmorTensor)
    own_acc, own_acc_norm, _ = own_scores(model, AutoTokenizer.from_pretrained(pruned_dir))
    assert acc == pytest.approx(own_acc, abs=1e-12)
    assert saved["results"]["tiny_mc"]["acc_norm,none"] == pytest.approx(own_acc_norm, abs=1e-12)

    target = pruned_dir.parent / "elsewhere" / "acc.json"
    code = main(["eval", str(pruned_dir), "--tasks", "tiny_mc", "--include-path", str(TASKS), "--limit", "5",
                 "--out", str(target), "--json", "--no-progress"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and printed["json"] == str(target)
    assert printed["results"]["tiny_mc"]["sample_len"] == 5
    assert json.loads(target.read_text())["results"] == printed["results"]


def test_cli_eval_tasks_without_lm_eval_is_one_line_exit_2(pruned_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-evaluation-harness were not installed
    code = main(["eval", str(pruned_dir), "--tasks", "tiny_mc", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "pip install 'torch_armor[eval]'" in err and "Traceback" not in err, err


# ---------------------------------------------------------------- offline: the task data checked first


def test_missing_task_data_names_the_tasks_and_how_to_run_offline(tmp_path):
    from torch_armor.recipes.harness import OFFLINE_HINT, missing_task_data

    arc = {"arc_easy": ("allenai/ai2_arc", "ARC-Easy"), "boolq": ("aps/super_glue", "boolq")}
    line = missing_task_data(arc, online=False, cache_dirs=[tmp_path])
    assert line.startswith("tasks=arc_easy, boolq: their data (allenai/ai2_arc ARC-Easy, aps/super_glue boolq)")
    assert line.endswith(OFFLINE_HINT) and "HF_DATASETS_OFFLINE=1" in line and "\n" not in line
    assert missing_task_data(arc, online=True, cache_dirs=[]) is None  # the hub answers: it fetches them
    (tmp_path / "allenai___ai2_arc").mkdir()  # the datasets cache's folder of a hub dataset
    (tmp_path / "datasets--aps--super_glue").mkdir()  # the hub cache's
    assert missing_task_data(arc, online=False, cache_dirs=[tmp_path]) is None
    local = {"mine": ("json", None), "dir": (str(tmp_path), None)}  # local files never need the hub
    assert missing_task_data(local, online=False, cache_dirs=[]) is None


def test_task_datasets_expands_groups_and_tags():
    from torch_armor.recipes.harness import _task_manager, task_datasets

    manager = _task_manager(["arc_easy"], ())
    assert task_datasets(manager, ["arc_easy"]) == {"arc_easy": ("allenai/ai2_arc", "ARC-Easy")}
    assert task_datasets(manager, ["ai2_arc"]) == {"arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
                                                   "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge")}
    assert task_datasets(_task_manager(["tiny_mc"], (str(TASKS),)), ["tiny_mc"]) == {}  # its own loader


def test_cli_eval_tasks_offline_fails_in_one_line_before_loading_the_model(tmp_path):
    """No network, an empty cache: one line saying how to run offline, before the model is read (the
    model directory here cannot even be loaded: its error would come first otherwise)."""
    import os
    import subprocess

    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("HF_DATASETS_CACHE", None), env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run([sys.executable, "-m", "torch_armor", "eval", str(broken), "--tasks", "arc_easy"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("torch-armor eval: error: --tasks arc_easy: its data (allenai/ai2_arc ARC-Easy)")
    assert "HF_DATASETS_OFFLINE=1" in proc.stderr and "Retry" not in proc.stderr
