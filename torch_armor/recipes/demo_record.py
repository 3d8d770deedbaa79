"""The recorded demo run the demo's estimate scales (written by benchmarks/demo_time.py; do not edit)."""

DEMO_RECORD = {'command': 'python benchmarks/demo_time.py --record --threads 1',
 'forward_cpu_s': 1.8002,
 'forward_s': 1.8097,
 'load': [0.73, 1.02],
 'machine': '2 cores of Intel(R) Xeon(R) Processor',
 'rows': {'armor': {'cpu_s': 1028.5, 'eval_s': 44.2, 'prune_s': 988.7},
          'dense': {'cpu_s': 36.5, 'eval_s': 36.7, 'prune_s': 0.0},
          'magnitude': {'cpu_s': 99.6, 'eval_s': 37.0, 'prune_s': 63.1},
          'nowag': {'cpu_s': 96.7, 'eval_s': 38.5, 'prune_s': 58.6},
          'sparsegpt': {'cpu_s': 157.2, 'eval_s': 36.3, 'prune_s': 121.4},
          'wanda': {'cpu_s': 87.5, 'eval_s': 32.6, 'prune_s': 55.2}},
 'settings': {'armor': "ArmorConfig(block_size=16, block_sizes=(), max_overhead=0.05, pattern='2:4', seed=0, "
                       'dtype=torch.float32, device=None, optimizer=BcdConfig(iters=8, cg_steps=2, '
                       'group_updates=None, ridge=1e-06, selection=None, time_budget_s=None, tol=0.0, '
                       'log_every=1), refine=RefineConfig(rounds=1, cg_steps=30, damp=0.01, core_steps=0), '
                       'reconstruct=ReconstructConfig(steps=24, lr=0.005, micro_batch=1, warmup=0.1, '
                       "decay='cosine', held_out=4, checks=4, patience=None, split_stages=False, "
                       "target='block'), distill=DistillConfig(steps=8, lr=0.001, windows_per_step=2, "
                       "held_out=4, top_k=64, eval_every=4, train_core=False, warmup=0.0, decay='constant', "
                       'sampled_windows=0, sample_prompt_tokens=1, sampled_in_block_pass=False, '
                       'bf16_steps=False))',
              'n_calib': 16,
              'n_eval': 16,
              'seq_len': 512}}
