#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/raven/d' sage.txt
