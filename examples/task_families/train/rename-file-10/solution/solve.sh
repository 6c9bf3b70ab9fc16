#!/bin/bash
# The reference solution, run in /app.
set -e
mv quartz.txt velvet.txt
