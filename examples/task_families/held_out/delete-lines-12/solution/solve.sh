#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/lemon/d' garnet.txt
