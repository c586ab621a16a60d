// Prints each test's result as it ends, and every minute which test is still running. Under
// emulation one KVM test file takes minutes, and jest's default reporter is silent until a file
// ends: this keeps CI's log told what is running, and lets the nested harness's silence watchdog
// tell a slow test (the heartbeat goes on) from a wedged L1 (everything stops).
//
// With PVISOR_TEST_PROGRESS_FILE set, each finished test file appends one JSON line
// {file, passed, failed, ms} there, so scripts/run-tests.js knows which files a killed run finished.
'use strict';
const { appendFileSync } = require('node:fs');

const HEARTBEAT_MS = 60_000;

class ProgressReporter {
  onRunStart() {
    this.current = 'starting';
    this.since = Date.now();
    this.timer = setInterval(() => {
      process.stderr.write(`  [..] ${this.current} (${Math.round((Date.now() - this.since) / 1000)} s so far)\n`);
    }, HEARTBEAT_MS);
    this.timer.unref();
  }

  onTestCaseStart(_test, info) {
    this.current = info.fullName;
    this.since = Date.now();
  }

  onTestCaseResult(_test, result) {
    const mark = result.status === 'passed' ? 'ok' : result.status;
    process.stderr.write(`  [${mark}] ${result.fullName} (${result.duration ?? 0} ms)\n`);
    this.current = 'between tests';
    this.since = Date.now();
  }

  onTestFileResult(test, result) {
    const log = process.env.PVISOR_TEST_PROGRESS_FILE;
    if (!log) return;
    const failed = result.numFailingTests + (result.testExecError ? 1 : 0);
    const ms = result.perfStats ? result.perfStats.end - result.perfStats.start : undefined;
    appendFileSync(log, `${JSON.stringify({ file: test.path, passed: result.numPassingTests, failed, ms })}\n`);
  }

  onRunComplete() {
    clearInterval(this.timer);
  }
}

module.exports = ProgressReporter;
