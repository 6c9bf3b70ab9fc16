#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/pine/d' copper.txt
