#!/usr/bin/env bash
# The main job end to end on generated data: make the shapes dataset, train configs/tiny.yaml, index, search.
set -euo pipefail
BIN=${1:-.venv/bin}
cd "$(dirname "$0")/.."

if [ ! -f data/shapes/images/train_09999.png ]; then   # absent, or an older/smaller generation
  "$BIN/python" -m clip_mini.data.synthetic --out data/shapes --n 10000 --seed 0
fi
# --resume auto: a second `make demo` reuses the finished run (and an interrupted one continues) instead of refusing
# to start over on top of its checkpoints; `make clean` removes it to train afresh.
"$BIN/clip-mini" train --config configs/tiny.yaml --set train.out_dir=runs/tiny --resume auto
"$BIN/clip-mini" eval --model runs/tiny/best --data configs/tiny.yaml --split val
# Held-out and harder: compositional_test.csv, images whose first object is a colour-shape pair no training caption
# names (e.g. a red star). The whole file is scored as one split: with val and test sizes 0 every image lands in
# the split called "train", a name only; the model never trained on any of these images.
echo; echo "== recall on the compositional split (data/shapes/compositional_test.csv, never trained on)"
"$BIN/clip-mini" eval --model runs/tiny/best --data configs/tiny.yaml --split train \
  --set data.captions=data/shapes/compositional_test.csv --set data.val=0 --set data.test=0
# The demo's index belongs to the demo's model: a retrained model (a changed config, `make clean` of runs/ only)
# gets a fresh index instead of the "built with another model" refusal a user's own index would give.
"$BIN/python" - <<'PY'
import json, pathlib, shutil
index = pathlib.Path("indexes/shapes/manifest.json")
model = json.loads(pathlib.Path("runs/tiny/best/manifest.json").read_text())["fingerprint"]
if index.is_file() and json.loads(index.read_text()).get("model_fingerprint") != model:
    shutil.rmtree(index.parent)
    print("demo: runs/tiny/best is a new model, so indexes/shapes is built afresh")
PY
"$BIN/clip-mini" index --model runs/tiny/best --images data/shapes/images --out indexes/shapes
for q in "a large red circle on the left" "a blue star above a green square" "a small yellow triangle at the bottom"; do
  echo; echo "== $q"
  "$BIN/clip-mini" search --index indexes/shapes "$q" -k 5
done
"$BIN/clip-mini" search --index indexes/shapes "a large red circle on the left" -k 16 --cutoff none --grid hits.png > /dev/null
"$BIN/clip-mini" attention --model runs/tiny/best data/shapes/images/train_00000.png --out attn.png
echo; echo "wrote hits.png (top 16 for 'a large red circle on the left') and attn.png; model in runs/tiny/best"
