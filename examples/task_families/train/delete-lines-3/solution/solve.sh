#!/bin/bash
# The reference solution, run in /app.
set -e
sed -i '/orchid/d' juniper.txt
