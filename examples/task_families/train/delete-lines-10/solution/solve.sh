#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/delta/d' orchid.txt
