"""Sum `ncu --csv --metrics gpu__time_duration.sum[,dram__bytes_read.sum]` rows by kernel name
(stdin → stdout): launches, total and mean time, and with DRAM bytes their total and rate."""
import csv
import sys
from collections import defaultdict

tot, cnt, dram = defaultdict(float), defaultdict(int), defaultdict(float)
rows = [l for l in sys.stdin if l.startswith('"')]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
for r in csv.DictReader(rows):
    name = r["Kernel Name"].split("(")[0]
    v = float(r["Metric Value"].replace(",", "")) * scale.get(r.get("Metric Unit", ""), 1.0)
    if r.get("Metric Name") == "gpu__time_duration.sum":
        tot[name] += v
        cnt[name] += 1
    elif r.get("Metric Name") == "dram__bytes_read.sum":
        dram[name] += v
for name, us in sorted(tot.items(), key=lambda kv: -kv[1]):
    line = f"{name:28s} {cnt[name]:5d} launches {us:10.1f} us total {us / cnt[name]:8.2f} us each"
    if name in dram:
        line += f" {dram[name] / 1e6:9.1f} MB {dram[name] / us / 1e6:6.2f} TB/s"
    print(line)
