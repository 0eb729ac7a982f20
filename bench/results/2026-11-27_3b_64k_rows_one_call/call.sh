#!/usr/bin/env bash
# 64K tokens at 24 GiB: this project, RoundPipe's exact step and FSDP2 in one call.
ROWS=ours@65536,roundpipe@65536,fsdp2@65536 TOTAL_S=560 OUT=$OUT bash bench/long_rows.sh
cat $OUT/long_rows.md 2>/dev/null
cd $OUT && tar czf all.tgz --exclude=all.tgz . && find . -mindepth 1 -not -name all.tgz -delete
