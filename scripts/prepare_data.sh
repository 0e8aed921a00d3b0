#!/usr/bin/env bash
# Prepares a real English corpus for training: the npm package nlp-corpus (about 9 MB of
# English sentences: film reviews, transcripts, speeches, SMS, lyrics...), fetched with
# `npm pack` (no install, no scripts run, tarball checked against its SHA-1), GPT-2's tokenizer
# files (scripts/fetch_tokenizer.sh), then `fp8lm tokenize` into llm.c shards:
#   DIR/tokenizer/encoder.json, vocab.bpe
#   DIR/nlp-corpus/text/doc-*.json          the corpus (JSON arrays of sentences)
#   DIR/nlp-corpus/train_000000.bin ...      train shards
#   DIR/nlp-corpus/val_000000.bin ...        validation shards (5% of the sentences)
# Usage: scripts/prepare_data.sh [DIR]      (DIR defaults to data/, which git ignores)
# Idempotent: each step is skipped when its output is complete. Needs build/fp8lm (or
# FP8LM_BIN) and npm. Exit 0: the shards are there; 3: npm is missing; 1: other failure.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$repo/data}
fp8lm=${FP8LM_BIN:-$repo/build/fp8lm}
package=nlp-corpus@4.4.0
package_sha1=5a43e1851f3b1c4549d81fbe0a68129c8beed650  # the registry's dist.shasum
val_fraction=0.05

say() { echo "prepare_data: $*" >&2; }
fail() { say "$1"; exit "${2:-1}"; }

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
corpus=$dir/nlp-corpus
text=$corpus/text

# 1. The tokenizer files.
"$repo/scripts/fetch_tokenizer.sh" "$dir/tokenizer" || exit $?

# 2. The corpus text. text/.complete is written last, so an interrupted fetch starts again.
if [ -f "$text/.complete" ]; then
  say "corpus text already in $text"
else
  command -v npm >/dev/null 2>&1 || fail "npm is not installed. HINT: apt-get install npm" 3
  mkdir -p "$corpus"
  work=$(mktemp -d "$corpus/.fetch.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  if ! (cd "$work" && npm pack "$package" --silent > npm.log 2>&1); then
    say "'npm pack $package' failed:"
    tail -5 "$work/npm.log" >&2
    exit 1
  fi
  tarball=$(ls "$work"/nlp-corpus-*.tgz)
  echo "$package_sha1  $tarball" | sha1sum -c --status - ||
    fail "$tarball: SHA-1 differs from the registry's $package_sha1 (a different or damaged package)"
  tar xzf "$tarball" -C "$work"
  ls "$work"/package/builds/doc-*.json >/dev/null 2>&1 || fail "$package holds no builds/doc-*.json"
  rm -rf "$text"
  mv "$work/package/builds" "$text"
  cp "$work/package/README.md" "$text/README.md"
  touch "$text/.complete"
  rm -rf "$work"
  trap - EXIT
  say "corpus text: $(ls "$text"/doc-*.json | wc -l) files, $(du -sh "$text" | cut -f1) in $text"
fi

# 3. Tokenize. .tokenized (tokenize's summary) is written after every shard is in place.
if [ -f "$corpus/.tokenized" ]; then
  say "shards already in $corpus: $(cat "$corpus/.tokenized")"
  exit 0
fi
[ -x "$fp8lm" ] || fail "$fp8lm not found. HINT: build it first (scripts/setup.sh), or set FP8LM_BIN"
rm -f "$corpus"/train_*.bin "$corpus"/val_*.bin "$corpus"/*.bin.tmp  # a partial earlier run
log=$corpus/tokenize.log
if ! "$fp8lm" tokenize --input "$text/doc-*.json" --output "$corpus" \
     --vocab-file "$dir/tokenizer/encoder.json" --merge-file "$dir/tokenizer/vocab.bpe" \
     --val-fraction "$val_fraction" 2>&1 | tee "$log" >&2; then
  fail "fp8lm tokenize failed (log: $log)"
fi
summary=$(grep -o 'tokenize: [0-9]* documents.*' "$log" | tail -1)
echo "$summary" > "$corpus/.tokenized"
say "train with --train-data-path '$corpus/train_*.bin' --valid-data-path '$corpus/val_*.bin'"
