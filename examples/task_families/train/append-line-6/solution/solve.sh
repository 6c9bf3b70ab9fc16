#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'apple delta' >> dune.txt
