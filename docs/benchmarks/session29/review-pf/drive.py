import sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from emu import run_case
cases = [
 # name, dec, chunks, nh, nkv, HD, wave, kwargs
 ("G4 hd256 256@16128 w33", [], [(256, 16128)], 16, 4, 256, 33, {}),
 ("G4 hd256 5@12000 w33", [300], [(5, 12000)], 16, 4, 256, 33, {}),
 ("G4 hd256 mix w33", [700, 20], [(256, 4000), (40, 1500), (7, 9000)], 16, 4, 256, 33, {}),
 ("G4 hd256 mix w7", [5], [(3, 2000), (100, 900), (7, 5000)], 16, 4, 256, 7, {}),
 ("G4 hd256 mix w66", [], [(300, 12000), (33, 11000), (5, 0), (64, 3000)], 16, 4, 256, 66, {}),
 ("G4 hd256 300@0 w33 (no split)", [], [(300, 0)], 16, 4, 256, 33, {}),
 ("G2 hd64 5@12000 w66", [10], [(5, 12000)], 4, 2, 64, 66, {}),
 ("G2 hd64 mix w66", [], [(300, 7000), (17, 12000), (129, 513)], 4, 2, 64, 66, {}),
 ("G2 hd64 mix w7", [3, 4], [(64, 6000), (65, 6001), (200, 100)], 4, 2, 64, 7, {}),
 ("G2 hd64 mix w33", [], [(31, 11999), (250, 3333)], 4, 2, 64, 33, {}),
 ("G4 hd256 MIXED graph cap256 w33", [500, 40, 9], [(150, 10000), (60, 2500), (3, 700)], 16, 4, 256, 33, {"mixed_cap": 256}),
 ("G2 hd64 MIXED graph cap256 w66", [500], [(200, 12000), (20, 4000)], 4, 2, 64, 66, {"mixed_cap": 256}),
 ("G2 hd64 MIXED graph cap256 w7", [500], [(5, 12000), (250, 64)], 4, 2, 64, 7, {"mixed_cap": 256}),
]
sel = sys.argv[1:] 
worst = 0
for i, (name, dec, ch, nh, nkv, hd, wave, kw) in enumerate(cases):
    if sel and str(i) not in sel: continue
    t = time.time()
    worst = max(worst, run_case(name, dec, ch, nh, nkv, hd, wave, seed=i, **kw))
print("worst", worst)
