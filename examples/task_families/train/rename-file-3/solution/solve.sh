#!/bin/bash
# The reference solution, run in /app.
set -e
mv indigo.txt quartz.txt
