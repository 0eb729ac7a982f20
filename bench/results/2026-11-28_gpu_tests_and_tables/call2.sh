#!/bin/bash
# What is on the GPU at the peak of the two plan-test rows the plan misjudges most (whole 16K
# rows, 19% over; 4 tiled segments of 32K, 13% under), then the long-row table's 128K, 64K and
# 16K rows (this project, RoundPipe's exact step, FSDP2 at 16K) back to back.
set -u
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl-site .whl/*.whl \
  > /dev/null 2>&1
export PYTHONPATH=$PWD/.whl-site PATH=$PWD/.whl-site/bin:$PATH
F="--config '' --model llama-3b --num_layers 4 --dataset synthetic --allow_long_sequences --batch_size 1
   --num_chunks 1 --num_stages 6 --device cuda --dtype bfloat16 --use_offload --resident_stages 0
   --activation_checkpointing --activation_offload --num_iterations 2 --no_save_model --no_progress_bar
   --overwrite --save_dir /tmp/peak"
eval timeout 60 python3 bench/memory_at_peak.py --out $OUT/peak_16k_whole.txt -- $F --seq_length 16384 > $OUT/peak_16k_whole.log 2>&1
eval timeout 60 python3 bench/memory_at_peak.py --out $OUT/peak_32k_seg4_tiled.txt -- $F --seq_length 32768 \
  --seq_chunks 4 --tiled_mlp true > $OUT/peak_32k_seg4_tiled.log 2>&1
tail -n 3 $OUT/peak_*.log
# only 8 files come back: the table's folder goes back as one archive
OUT=$OUT/lr TOTAL_S=$(( 550 - ($(date +%s) - t0) )) \
  ROWS=ours@131072,ours@65536,roundpipe@65536,ours@16384,roundpipe@16384,fsdp2@16384 bash bench/long_rows.sh
cp $OUT/lr/long_rows.md $OUT/ 2>/dev/null
tar czf $OUT/lr.tgz -C $OUT lr && rm -rf $OUT/lr
