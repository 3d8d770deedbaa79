"""The recorded demo run the demo's estimate scales (written by benchmarks/demo_time.py; do not edit)."""

DEMO_RECORD = {'check': None, 'command': 'placeholder', 'forward_s': 1.0, 'forward_cpu_s': 1.0, 'load': [0, 0],
               'machine': 'placeholder',
               'rows': {m: {'cpu_s': 100.0, 'eval_s': 16.0, 'prune_s': 84.0}
                        for m in ('armor', 'dense', 'magnitude', 'nowag', 'sparsegpt', 'wanda')},
               'settings': {'armor': 'x', 'n_calib': 16, 'n_eval': 16, 'seq_len': 512}}
