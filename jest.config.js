// Tests are compiled by `tsc` first and jest runs the JavaScript: no transform at test time, which
// matters inside the nested KVM harness where every CPU instruction is emulated.
module.exports = {
  testEnvironment: 'node',
  roots: ['<rootDir>/dist/test'],
  testMatch: ['**/*.test.js'],
  testTimeout: 120000,
  reporters: ['default', '<rootDir>/scripts/jest-progress-reporter.js'],
};
