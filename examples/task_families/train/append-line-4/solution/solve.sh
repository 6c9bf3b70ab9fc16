#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'falcon dune' >> juniper.txt
