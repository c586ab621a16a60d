// Prints each test's result as it ends. Under emulation one KVM test file takes minutes, and
// jest's default reporter is silent until a file ends: this keeps CI's log (and the nested
// harness's silence watchdog) told what is running.
'use strict';

class ProgressReporter {
  onTestCaseResult(test, result) {
    const mark = result.status === 'passed' ? 'ok' : result.status;
    process.stderr.write(`  [${mark}] ${result.fullName} (${result.duration ?? 0} ms)\n`);
  }
}

module.exports = ProgressReporter;
