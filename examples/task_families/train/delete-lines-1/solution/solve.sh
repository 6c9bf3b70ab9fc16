#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/ember/d' pine.txt
