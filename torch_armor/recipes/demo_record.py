"""The recorded demo run the demo's estimate scales (written by benchmarks/demo_time.py; do not edit)."""

DEMO_RECORD = {'command': 'python benchmarks/demo_time.py --record --threads 1',
 'forward_cpu_s': 1.5362,
 'forward_s': 2.2706,
 'load': [5.9, 2.44],
 'machine': '2 cores of Intel(R) Xeon(R) Processor',
 'rows': {'armor': {'cpu_s': 1081.3, 'eval_s': 30.6, 'prune_s': 1442.1},
          'dense': {'cpu_s': 30.1, 'eval_s': 44.1, 'prune_s': 0.0},
          'magnitude': {'cpu_s': 80.6, 'eval_s': 54.1, 'prune_s': 72.3},
          'nowag': {'cpu_s': 88.9, 'eval_s': 45.4, 'prune_s': 127.7},
          'sparsegpt': {'cpu_s': 131.4, 'eval_s': 86.6, 'prune_s': 265.7},
          'wanda': {'cpu_s': 82.3, 'eval_s': 87.5, 'prune_s': 123.4}},
 'settings': {'armor': "ArmorConfig(block_size=16, block_sizes=(), max_overhead=0.05, pattern='2:4', seed=0, "
                       'dtype=torch.float32, device=None, optimizer=BcdConfig(iters=10, cg_steps=2, '
                       'group_updates=None, ridge=1e-06, selection=None, time_budget_s=None, tol=0.0, '
                       'log_every=1), refine=RefineConfig(rounds=1, cg_steps=30, damp=0.01, core_steps=0), '
                       'reconstruct=ReconstructConfig(steps=32, lr=0.005, micro_batch=1, warmup=0.1, '
                       "decay='cosine', held_out=4, checks=4, patience=None, split_stages=False, "
                       "target='block'), distill=DistillConfig(steps=16, lr=0.001, windows_per_step=2, "
                       "held_out=4, top_k=64, eval_every=4, train_core=False, warmup=0.0, decay='constant', "
                       'sampled_windows=0, sample_prompt_tokens=1, sampled_in_block_pass=False, '
                       'bf16_steps=False))',
              'n_calib': 16,
              'n_eval': 16,
              'seq_len': 512}}
