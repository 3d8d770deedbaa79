"""Tests for torch_armor.recipes.data: text sources, tokenization and token windows."""

from __future__ import annotations

import pytest
import torch

from torch_armor.errors import ArmorInputError
from torch_armor.recipes import data
from torch_armor.recipes.data import calibration_windows, eval_windows, load_text, tokenize_text

WORDS = ["hello", "world", "alpha", "beta", "gamma", "delta"]


def make_word_tokenizer(add_bos: bool):
    """A real (offline) Hugging Face fast tokenizer: one id per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def word_ids(text: str) -> list[int]:
    """Independent reference for make_word_tokenizer without special tokens."""
    return [WORDS.index(w) + 3 if w in WORDS else 0 for w in text.split()]


# -- tokenize_text ---------------------------------------------------------------------------


def test_tokenize_prepends_bos_only_when_default_encoding_has_it():
    text = "hello world gamma unknownword"
    with_bos = tokenize_text(text, make_word_tokenizer(add_bos=True))
    without = tokenize_text(text, make_word_tokenizer(add_bos=False))
    assert with_bos.dtype == torch.long and with_bos.dim() == 1
    assert with_bos.tolist() == [1] + word_ids(text)  # BOS, but never the template's EOS
    assert without.tolist() == word_ids(text)


def test_tokenize_smollm2_has_no_bos(smollm2_tokenizer):
    text = "The quick brown fox.\n\nJumps over the lazy dog."
    ids = tokenize_text(text, smollm2_tokenizer)
    assert ids.tolist() == smollm2_tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0].item() != smollm2_tokenizer.bos_token_id
    assert smollm2_tokenizer.decode(ids.tolist()) == text


def test_tokenize_rejects_bad_inputs():
    with pytest.raises(ValueError, match="text must be a str"):
        tokenize_text(["hello"], make_word_tokenizer(False))
    with pytest.raises(ValueError, match="tokenizer must be"):
        tokenize_text("hello", None)


# -- load_text -------------------------------------------------------------------------------


def test_load_text_list_file_dir_glob(tmp_path):
    assert load_text(["a", "b", "c"]) == "a\n\nb\n\nc"
    assert load_text(("only",)) == "only"

    (tmp_path / "b.txt").write_text("second\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first é", encoding="utf-8")
    (tmp_path / "c.md").write_text("not text", encoding="utf-8")
    assert load_text(str(tmp_path / "b.txt")) == "second\n"
    assert load_text(tmp_path / "a.txt") == "first é"
    expected = "first é" + "\n\n" + "second\n"
    assert load_text(tmp_path) == expected  # directory: *.txt only, sorted by name
    assert load_text(str(tmp_path)) == expected
    assert load_text(str(tmp_path / "*.txt")) == expected
    assert load_text(str(tmp_path / "*")) == expected + "\n\n" + "not text"


def test_load_text_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_text(tmp_path / "empty")
    with pytest.raises(ValueError, match="no text files"):
        load_text(str(tmp_path / "*.nothing"))
    with pytest.raises(ValueError, match="empty"):
        load_text([])
    with pytest.raises(ValueError, match="only strings"):
        load_text(["a", 3])
    with pytest.raises(TypeError, match="cannot read text"):
        load_text(42)
    with pytest.raises(ValueError, match="empty string"):
        load_text("  ")


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("fine text", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"ok \xe8\x00\xff binary")
    for source in (tmp_path / "b.txt", str(tmp_path)):  # the file itself, or a directory holding it
        with pytest.raises(ArmorInputError, match=r"b.txt is not UTF-8 text \(byte 0xe8 at offset 3\); give a text "
                                                  "file, or convert it to UTF-8"):
            load_text(source)


def test_windows_whose_token_ids_cannot_fit_in_memory_are_refused_before_tokenizing():
    tokenizer = lambda *a, **k: pytest.fail("tokenized")  # noqa: E731
    for n in (10**20, 10**12):
        with pytest.raises(ArmorInputError, match=rf"n_windows {n} × seq_len 512 = .* token ids, .* GiB, more than this "
                                                  r"machine's .* GiB of memory; ask for fewer windows"):
            calibration_windows("some text", tokenizer, n_windows=n, seq_len=512)
    with pytest.raises(ArmorInputError, match=r"^--n-calib 99999999999999999999 × --seq-len 32 = "):
        data.check_window_memory(99999999999999999999, 32, ("--n-calib", "--seq-len"))


def test_load_text_dataset_columns():
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["x", "y"], "body": ["p", "q"]})
    assert load_text(ds) == "x\n\ny"
    assert load_text(ds, text_column="body") == "p\n\nq"
    with pytest.raises(ValueError, match="no column 'content'.*text_column"):
        load_text(ds, text_column="content")
    with pytest.raises(ValueError, match="pick one split"):
        load_text(datasets.DatasetDict({"train": ds}))


def test_load_text_hub_dataset_path(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_dict({"text": [f"{name}/{config}/{split}", "tail"]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    text = load_text("wikitext", config="wikitext-2-raw-v1", split="test")
    assert calls == [("wikitext", "wikitext-2-raw-v1", "test")]
    assert text == "wikitext/wikitext-2-raw-v1/test\n\ntail"

    def failing(name, config=None, split=None):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(ValueError, match="not a local file.*no network"):
        load_text("some/dataset")


def test_load_text_named_sources(sotu_available, wiki_available):
    from torch_armor.recipes.assets import sotu_text, wiki_text

    assert load_text("sotu") == sotu_text()
    assert load_text("wiki") == wiki_text()


# -- windows ---------------------------------------------------------------------------------


def test_calibration_windows_follow_protocol():
    ids = torch.randint(0, 1000, (5000,), generator=torch.Generator().manual_seed(7))
    n, seq_len, seed = 9, 37, 3
    windows = calibration_windows(ids, None, n_windows=n, seq_len=seq_len, seed=seed)
    # reference: the protocol's randint with a fresh seeded generator, sliced one by one
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (n,), generator=g).tolist()
    reference = torch.stack([ids[s : s + seq_len] for s in starts])
    assert windows.shape == (n, seq_len) and windows.dtype == torch.long
    assert torch.equal(windows, reference)
    assert torch.equal(calibration_windows(ids, None, n, seq_len, seed), windows)
    assert not torch.equal(calibration_windows(ids, None, n, seq_len, seed + 1), windows)


def test_calibration_windows_exact_length_and_errors():
    ids = torch.arange(16)
    # N == seq_len: the only start is 0
    assert torch.equal(calibration_windows(ids, None, n_windows=3, seq_len=16), ids.repeat(3, 1))
    with pytest.raises(ValueError, match="has 16 tokens but one window needs 17"):
        calibration_windows(ids, None, n_windows=1, seq_len=17)
    with pytest.raises(ValueError, match="n_windows must be a positive integer"):
        calibration_windows(ids, None, n_windows=0, seq_len=4)
    with pytest.raises(ValueError, match="1-D integer"):
        calibration_windows(ids.float(), None, n_windows=1, seq_len=4)


def test_eval_windows_first_non_overlapping():
    ids = torch.randint(0, 50, (103,), generator=torch.Generator().manual_seed(0))
    windows = eval_windows(ids, None, n_windows=4, seq_len=25)
    reference = torch.stack([ids[i * 25 : (i + 1) * 25] for i in range(4)])
    assert torch.equal(windows, reference)
    windows[0, 0] = -1  # a copy, not a view of the caller's ids
    assert ids[0] != -1
    with pytest.raises(ValueError, match="has 103 tokens but 5 windows of 25 need 125.*at most 4"):
        eval_windows(ids, None, n_windows=5, seq_len=25)


def test_windows_from_text_sources(tmp_path):
    tok = make_word_tokenizer(add_bos=True)
    words = [WORDS[i % len(WORDS)] for i in range(40)]
    (tmp_path / "doc.txt").write_text(" ".join(words[:20]), encoding="utf-8")
    (tmp_path / "doc2.txt").write_text(" ".join(words[20:]), encoding="utf-8")
    expected_ids = torch.tensor([1] + word_ids(" ".join(words)))  # BOS once, at the start
    w = eval_windows(tmp_path, tok, n_windows=4, seq_len=10)
    assert torch.equal(w, expected_ids[:40].reshape(4, 10))
    c = calibration_windows(tmp_path, tok, n_windows=5, seq_len=8, seed=1)
    assert torch.equal(c, calibration_windows(expected_ids, None, n_windows=5, seq_len=8, seed=1))
    with pytest.raises(ValueError, match="has 41 tokens"):
        eval_windows(tmp_path, tok, n_windows=5, seq_len=10)
    with pytest.raises(ValueError, match="tokenizer must be"):
        eval_windows(tmp_path, None, n_windows=1, seq_len=4)


def test_load_kwargs_reach_load_text():
    import datasets

    ds = datasets.Dataset.from_dict({"body": ["hello world"] * 3})
    tok = make_word_tokenizer(add_bos=False)
    w = eval_windows(ds, tok, n_windows=3, seq_len=2, text_column="body")
    assert w.tolist() == [[3, 4]] * 3


def test_module_exports():
    assert set(data.__all__) == {"tokenize_text", "load_text", "check_window_memory", "calibration_windows",
                                 "eval_windows"}
