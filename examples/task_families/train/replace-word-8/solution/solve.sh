#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i 's/indigo/copper/g' juniper.txt
