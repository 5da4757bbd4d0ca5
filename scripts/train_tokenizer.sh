#!/usr/bin/env bash
# Trains a SentencePiece BPE tokenizer for train_gpt --tokenizer (and `train_gpt tokenize`) with spm_train
# (Debian package sentencepiece, installed by scripts/setup.sh).
#
#   scripts/train_tokenizer.sh OUT_PREFIX [VOCAB_SIZE] [TEXT_FILE...]
#     writes OUT_PREFIX.model (what --tokenizer takes) and OUT_PREFIX.vocab (the pieces, for reading);
#     VOCAB_SIZE defaults to 2000, the text to the fortunes corpus train_gpt trains on by default.
#
# The settings make encoding lossless (decode(encode(text)) == text for any UTF-8 text), as Llama's
# tokenizer is: --byte_fallback (a character the vocabulary lacks becomes its UTF-8 bytes, <0x..> pieces,
# never <unk>), --normalization_rule_name=identity and --remove_extra_whitespaces=false (the text is not
# rewritten: NFKC and whitespace folding would change what the model sees). Newlines, which spm_train
# never sees (it reads one sentence per line), encode as the byte piece <0x0A>. Ids: <unk> 0, <s> 1, </s> 2
# (EOS: train_gpt ends each --sft example and each `tokenize` document with it), then the 256 byte pieces.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 OUT_PREFIX [VOCAB_SIZE] [TEXT_FILE...]" >&2
  exit 2
fi
out=$1
vocab=${2:-2000}
shift $(( $# >= 2 ? 2 : 1 ))
if [ $# -eq 0 ]; then
  # The default corpus (examples/train_gpt/data.h): the fortune files, not their *.dat indexes or *.u8 links.
  mapfile -t files < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
else
  files=("$@")
fi
if ! command -v spm_train >/dev/null; then
  echo "$0: spm_train not found. Fix: apt-get install sentencepiece (scripts/setup.sh does)" >&2
  exit 1
fi
[ ${#files[@]} -gt 0 ] || { echo "$0: no text files" >&2; exit 1; }
input=$(IFS=,; echo "${files[*]}")
mkdir -p "$(dirname "$out")"
spm_train --input="$input" --model_prefix="$out" --vocab_size="$vocab" --model_type=bpe \
  --byte_fallback=true --character_coverage=0.9995 --normalization_rule_name=identity \
  --remove_extra_whitespaces=false --max_sentence_length=16384 --num_threads=2 \
  --minloglevel=1 >/dev/null
echo "$0: wrote $out.model ($vocab pieces, BPE, byte fallback) from ${#files[@]} file(s)"
