"""Sum `ncu --csv --metrics gpu__time_duration.sum` rows by kernel name (stdin → stdout)."""
import csv
import sys
from collections import defaultdict

tot, cnt = defaultdict(float), defaultdict(int)
rows = [l for l in sys.stdin if l.startswith('"')]
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"].split("(")[0]
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "nsecond")
    v *= {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1e-3)
    tot[name] += v
    cnt[name] += 1
for name, us in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"{name:28s} {cnt[name]:5d} launches {us:10.1f} us total {us / cnt[name]:8.2f} us each")
