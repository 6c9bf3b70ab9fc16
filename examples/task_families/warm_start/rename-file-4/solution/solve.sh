#!/bin/bash
# The reference solution, run in /app.
set -e
mv saffron.txt juniper.txt
