"""Loader of the tiny_mc task: the items of tiny_mc.jsonl beside this file, as a test split."""

import json
from pathlib import Path

import datasets

ITEMS = Path(__file__).with_name("tiny_mc.jsonl")


def items():
    """The task's items as dicts (question, choices, label)."""
    return [json.loads(line) for line in ITEMS.read_text().splitlines() if line.strip()]


def load(**kwargs):
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items())})
