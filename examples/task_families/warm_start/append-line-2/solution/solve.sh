#!/bin/bash
# The reference solution, run in /app.
set -e
echo 'delta indigo' >> juniper.txt
