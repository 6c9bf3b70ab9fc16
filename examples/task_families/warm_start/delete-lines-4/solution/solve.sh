#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/apple/d' juniper.txt
