"""Names shared by the ``torch-armor`` parser (:mod:`torch_armor.cli.parser`) and its subcommands
(:mod:`torch_armor.cli.commands`): output file names and the demo's two protocols."""

from torch_armor.engine.methods import method_names

__all__ = ["REPORT_JSON", "REPORT_PNG", "HARNESS_JSON", "DENSE", "DEMO_METHODS", "QUICK_PROTOCOL", "FULL_PROTOCOL"]

REPORT_JSON = "prune_report.json"
REPORT_PNG = "prune_report.png"
HARNESS_JSON = "lm_eval_results.json"
DENSE = "dense"
#: rows of the demo table, in order
DEMO_METHODS = (DENSE,) + tuple(method_names())
#: the demo's quick protocol (the default): a first table in minutes; --full is the README's. NoWag-P is
#: the reference of the "gap closed" column (ARMOR's starting point): without its row the column is empty.
#: ARMOR's row is most of the time (block pass, then distillation), hence fewer sweeps, reconstruction and
#: distillation steps (the table within 15 min on 2 idle cores: docs/results.md, "The demo's time")
QUICK_PROTOCOL = {"methods": (DENSE, "nowag", "sparsegpt", "armor"), "n_calib": 16, "n_eval": 16, "iters": 8,
                  "reconstruct_steps": 24, "distill_steps": 8}
FULL_PROTOCOL = {"methods": DEMO_METHODS, "n_calib": 64, "n_eval": 64, "iters": None, "reconstruct_steps": None,
                 "distill_steps": None}
