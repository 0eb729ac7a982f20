#!/bin/bash
# The long-row table's 16K and 32K rows (this project, RoundPipe's exact step, FSDP2) back to back,
# then the segment rows and FSDP2 at 64K as far as the call's time goes.
set -u
# only 8 files come back: the table's folder goes back as one archive
OUT=$OUT/lr TOTAL_S=${TOTAL_S:-545} \
  ROWS=ours@16384,roundpipe@16384,fsdp2@16384,ours@32768,roundpipe@32768,fsdp2@32768,ours@32768/seg8,ours@16384/seg4,ours@65536/seg8,fsdp2@65536 \
  bash bench/long_rows.sh
cp $OUT/lr/long_rows.md $OUT/ 2>/dev/null
tar czf $OUT/lr.tgz -C $OUT lr && rm -rf $OUT/lr
