import cProfile, pstats, time
from bench.control_plane.__main__ import _Cluster
c = _Cluster(1000)
for _ in range(3):
    c.heartbeats(); c.monitor.snapshot(c.now_s, c.registry.views())
pr = cProfile.Profile()
for _ in range(20):
    c.heartbeats()
    pr.enable(); c.monitor.snapshot(c.now_s, c.registry.views()); pr.disable()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(12)
ts=[]
for _ in range(20):
    c.heartbeats(); t=time.perf_counter(); v=c.registry.views(); t1=time.perf_counter(); c.monitor.snapshot(c.now_s, v); ts.append((t1-t, time.perf_counter()-t1))
print(sorted(ts, key=lambda x: x[1])[10])
