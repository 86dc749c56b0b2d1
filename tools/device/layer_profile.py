#!/usr/bin/env python3
"""Every kernel of one decoder layer of one decode step (ncu CSV from ab_b1.sh / ncu_step.sh) with its time, grid and
block: the launches between the 5th and 6th MLA decode kernels of the last step (the step: the second-last
'embedding' kernel to the last). usage: layer_profile.py NCU_CSV"""
import csv,sys
def load(f):
    rows=[]
    lines=[l for l in open(f) if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name")!="gpu__time_duration.sum": continue
        v=float(r["Metric Value"].replace(",",""))
        u=r.get("Metric Unit","ns")
        us=v/1000 if u in("ns","nsecond") else v if u in ("us","usecond") else v*1000
        rows.append((r["Kernel Name"].split('(')[0].replace('mlaserve::<unnamed>::','').replace('void ','')[:40], us, r.get("Grid Size",""), r.get("Block Size","")))
    return rows
rows=load(sys.argv[1])
marks=[i for i,r in enumerate(rows) if 'embedding' in r[0]]
step=rows[marks[-2]:marks[-1]]
# print layer 5: find 5th..6th occurrence of mla_decode_ws
dec=[i for i,r in enumerate(step) if 'mla_decode_ws' in r[0]]
a,b=dec[4],dec[5]
tot=0
for n,us,g,bl in step[a:b]:
    tot+=us; print(f"{us:7.2f} {n:40s} {g} {bl}")
print("layer total",tot)
