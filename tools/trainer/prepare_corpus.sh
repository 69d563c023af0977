#!/usr/bin/env bash
# Builds the training corpus of the tiny default model (deploy/models/tiny-moe) from public text:
#   OLMoE domain samples  $FMOE_CORPUS_DIR/olmoe-*.txt   (Apache-2.0)
#   King James Bible      Debian bible-kjv                (public domain)
#   GCIDE dictionary      Debian dict-gcide               (GPL-2+)
#   Puffin user prompts   $FMOE_PROMPTS_FILE, ids > 2000  (Apache-2.0; ids 1-2000 are evaluation
#                                                          prompts and are never used here)
# Writes OUT_DIR/train.txt and OUT_DIR/val.txt: documents separated by a line holding only "</s>"
# (the trainer's document separator), and OUT_DIR/corpus_stats.tsv. Deterministic: the same
# inputs give byte-identical outputs. About 1.6% of each domain's documents (every 64th) is held
# out for validation.
#
# Usage: tools/trainer/prepare_corpus.sh OUT_DIR
# Environment (defaults in brackets):
#   FMOE_CORPUS_DIR    [<repo>/../shared/data/corpus]
#   FMOE_PROMPTS_FILE  [<repo>/../shared/data/prompts/puffin-dev.jsonl]
#   FMOE_BIBLE_BYTES   [2500000]  cap on the Bible's share
#   FMOE_GCIDE_BYTES   [2500000]  cap on the dictionary's share (it is 40 MB uncompressed)
set -euo pipefail

die() { echo "prepare_corpus: error: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: $0 OUT_DIR"
OUT_DIR="$1"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CORPUS_DIR="${FMOE_CORPUS_DIR:-$REPO_ROOT/../shared/data/corpus}"
PROMPTS_FILE="${FMOE_PROMPTS_FILE:-$REPO_ROOT/../shared/data/prompts/puffin-dev.jsonl}"
BIBLE_BYTES="${FMOE_BIBLE_BYTES:-2500000}"
GCIDE_BYTES="${FMOE_GCIDE_BYTES:-2500000}"
BIBLE_DATA=/usr/lib/bible.data
GCIDE_DICT=/usr/share/dictd/gcide.dict.dz
GCIDE_INDEX=/usr/share/dictd/gcide.index

# ---- check inputs; name everything that is missing at once ----
missing=()
command -v python3 >/dev/null || missing+=("python3 (Debian package python3)")
command -v zcat >/dev/null || missing+=("zcat (Debian package gzip)")
command -v bible >/dev/null || missing+=("the 'bible' program (Debian package bible-kjv)")
[ -r "$BIBLE_DATA" ] || missing+=("$BIBLE_DATA (Debian package bible-kjv-text)")
[ -r "$GCIDE_DICT" ] && [ -r "$GCIDE_INDEX" ] \
  || missing+=("$GCIDE_DICT and $GCIDE_INDEX (Debian package dict-gcide)")
compgen -G "$CORPUS_DIR/olmoe-*.txt" >/dev/null \
  || missing+=("$CORPUS_DIR/olmoe-*.txt (set FMOE_CORPUS_DIR)")
[ -r "$PROMPTS_FILE" ] || missing+=("$PROMPTS_FILE (set FMOE_PROMPTS_FILE)")
if [ ${#missing[@]} -gt 0 ]; then
  for m in "${missing[@]}"; do echo "prepare_corpus: missing: $m" >&2; done
  if printf '%s\n' "${missing[@]}" | grep -q "Debian package"; then
    echo "prepare_corpus: install the packages with:" \
      "apt-get install -y bible-kjv bible-kjv-text dict-gcide python3 gzip" >&2
  fi
  die "${#missing[@]} input(s) missing"
fi

mkdir -p "$OUT_DIR"
RAW="$(mktemp -d)"
trap 'rm -rf "$RAW"' EXIT
export LC_ALL=C.UTF-8

# ---- raw text per source ----
bible -p /usr/lib -m 8192 "gen1:1-rev22:21" >"$RAW/bible.txt" \
  || die "bible -p /usr/lib failed (is bible-kjv-text complete?)"
zcat "$GCIDE_DICT" >"$RAW/gcide.txt" || die "zcat $GCIDE_DICT failed"

# ---- split into documents, cap, hold out, write (deterministic: no randomness, sorted inputs) --
python3 - "$CORPUS_DIR" "$PROMPTS_FILE" "$RAW" "$OUT_DIR" "$BIBLE_BYTES" "$GCIDE_BYTES" \
  "$GCIDE_INDEX" <<'PY'
import base64, glob, json, os, re, sys

corpus_dir, prompts_file, raw, out_dir = sys.argv[1:5]
bible_cap, gcide_cap = int(sys.argv[5]), int(sys.argv[6])
gcide_index = sys.argv[7]
SEP = "\n</s>\n"      # document separator understood by fmoe-train
HOLDOUT_EVERY = 64    # document i of a domain goes to validation when i % 64 == 63
PIECE_BYTES = 8192    # long documents are cut into pieces of about this size at paragraph ends

def clean(doc):
    # The separator must never occur inside a document.
    doc = "\n".join("< /s>" if l.strip() == "</s>" else l for l in doc.split("\n"))
    return doc.strip("\n")

def pieces(doc, para_sep):
    """Cuts a long document into pieces of ~PIECE_BYTES at paragraph boundaries."""
    out, cur, size = [], [], 0
    for para in doc.split(para_sep):
        cur.append(para)
        size += len(para.encode()) + len(para_sep)
        if size >= PIECE_BYTES:
            out.append(para_sep.join(cur)); cur, size = [], 0
    if cur:
        out.append(para_sep.join(cur))
    return [p for p in (clean(x) for x in out) if p.strip()]

def split_before(text, pattern):
    starts = [m.start() for m in re.finditer(pattern, text, flags=re.M)]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]

def cap(docs, limit):
    """Keeps evenly spaced documents so that about `limit` bytes remain."""
    total = sum(len(d.encode()) for d in docs)
    if total <= limit:
        return docs
    keep, acc = [], 0.0
    ratio = limit / total
    for d in docs:
        acc += ratio
        if acc >= 1.0:
            keep.append(d); acc -= 1.0
    return keep

domains = {}

# OLMoE samples: Wikipedia articles start with "# Title", arXiv papers with \title; code and C4
# have no marked boundaries. Everything long is cut into ~8 KB pieces at paragraph ends.
for path in sorted(glob.glob(os.path.join(corpus_dir, "olmoe-*.txt"))):
    name = os.path.basename(path)[len("olmoe-"):-len(".txt")]
    text = open(path, encoding="utf-8", errors="replace").read().replace("\r\n", "\n")
    if name == "wikipedia":
        docs = split_before(text, r"^# ")
    elif name == "arxiv":
        docs = split_before(text, r"^\\title\{")
    else:
        docs = [text]
    para_sep = "\n" if name == "c4" else "\n\n"
    domains[name] = [p for d in docs for p in pieces(d, para_sep)]

# KJV: one document per chapter, "Book N" then one verse per line without its number.
chapters, title, verses = [], None, []
for line in open(os.path.join(raw, "bible.txt"), encoding="utf-8", errors="replace"):
    line = line.rstrip("\n")
    m = re.match(r"^\s+(\d+) (.*)$", line)
    if m:
        verses.append(m.group(2).strip())
    elif line.strip() == "":
        continue
    elif line.startswith(" ") and verses:
        verses[-1] += " " + line.strip()   # wrapped continuation of a verse
    elif not line.startswith(" ") and verses and not re.match(r"^\S.* \d+$", line):
        verses[-1] += " " + line.strip()   # continuation starting at column 0
    else:
        if title and verses:
            chapters.append(title + "\n\n" + "\n".join(verses))
        title, verses = line.strip(), []
if title and verses:
    chapters.append(title + "\n\n" + "\n".join(verses))
domains["bible"] = cap([clean(c) for c in chapters], bible_cap)

# GCIDE: entries located through the dictd index (base64 offset and length into the
# uncompressed text), the 00-database-* header entries dropped, source tags and markup braces
# removed, indentation collapsed.
B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
def b64num(s):
    n = 0
    for ch in s:
        n = n * 64 + B64.index(ch)
    return n
data = open(os.path.join(raw, "gcide.txt"), "rb").read()
spans = set()
for line in open(gcide_index, encoding="utf-8", errors="replace"):
    parts = line.rstrip("\n").split("\t")
    if len(parts) < 3 or parts[0].startswith("00-database") or parts[0].startswith("00database"):
        continue
    spans.add((b64num(parts[1]), b64num(parts[2])))
entries = []
tag = re.compile(r"^\s*\[(1913 Webster|WordNet 1\.5|PJC|Webster 1913 Suppl\.|Century Dict\.|"
                 r"RN=?\d*|DC|MW10|Chambers 1881|Webster 1913)[^\]]*\]\s*$")
for off, length in sorted(spans):
    text = data[off:off + length].decode("utf-8", errors="replace")
    lines = [l.strip() for l in text.split("\n") if not tag.match(l)]
    body = "\n".join(l for l in lines if l)
    body = body.replace("{", "").replace("}", "")
    if len(body) > 40:
        entries.append(clean(body))
domains["gcide"] = cap(entries, gcide_cap)

# Puffin: user turns with id > 2000 only (1-2000 are evaluation prompts).
puffin = []
for line in open(prompts_file, encoding="utf-8"):
    row = json.loads(line)
    if int(row["id"]) > 2000 and row["prompt"].strip():
        puffin.append(clean("User: " + row["prompt"].strip()))
domains["puffin"] = puffin

train, val = [], []
stats = []
for name in sorted(domains):
    docs = domains[name]
    t = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    v = [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    train += t; val += v
    stats.append((name, len(t), sum(len(d.encode()) for d in t),
                  len(v), sum(len(d.encode()) for d in v)))

def write(path, docs):
    with open(path, "w", encoding="utf-8") as f:
        f.write(SEP.join(docs) + "\n")
write(os.path.join(out_dir, "train.txt"), train)
write(os.path.join(out_dir, "val.txt"), val)
with open(os.path.join(out_dir, "corpus_stats.tsv"), "w") as f:
    f.write("domain\ttrain_docs\ttrain_bytes\tval_docs\tval_bytes\n")
    for s in stats:
        f.write("\t".join(map(str, s)) + "\n")
print(f"{'domain':<22}{'train docs':>11}{'train bytes':>13}{'val docs':>9}{'val bytes':>11}")
for s in stats:
    print(f"{s[0]:<22}{s[1]:>11}{s[2]:>13}{s[3]:>9}{s[4]:>11}")
print(f"{'total':<22}{sum(s[1] for s in stats):>11}{sum(s[2] for s in stats):>13}"
      f"{sum(s[3] for s in stats):>9}{sum(s[4] for s in stats):>11}")
PY
echo "prepare_corpus: wrote $OUT_DIR/train.txt, $OUT_DIR/val.txt, $OUT_DIR/corpus_stats.tsv"
