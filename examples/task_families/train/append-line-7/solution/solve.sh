#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'dune velvet' >> ember.txt
