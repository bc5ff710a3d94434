import time, torch
torch.set_num_threads(int(__import__("sys").argv[1]))
a = torch.randn(512, 576, dtype=torch.bfloat16); w = torch.randn(3072, 576, dtype=torch.bfloat16)
for _ in range(5): a @ w.T
t = time.perf_counter(); n = 200
for _ in range(n): a @ w.T
dt = time.perf_counter() - t
print(f"{2*512*576*3072*n/dt/1e9:.0f} GF/s")
big = torch.randn(64_000_000 // 2, dtype=torch.bfloat16)  # 64 MB
t = time.perf_counter()
for _ in range(20): big.sum()
print(f"read {20*64/ (time.perf_counter()-t) / 1000:.1f} GB/s")
