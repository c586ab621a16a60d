import { GOALS, STUDY_TABLE1, STUDY_TABLE2, STUDY_TABLE3, TABLE3_GOALS, savingPercent, studyRowOf } from '../../src/bench/study-figures';

describe('the study figures the bench prints', () => {
  it('saving is computed as the study does, against the default of the same working set', () => {
    // Table 1's own rows reproduce its saving column (to its rounding).
    for (const mode of ['idle-release', 'offload', 'compressed-offload', 'cold-compression']) {
      for (const c of ['repetitive', 'random'] as const) {
        const ours = savingPercent(STUDY_TABLE1.default.residentMiB[c], STUDY_TABLE1[mode].residentMiB[c]);
        expect(Math.abs(ours - STUDY_TABLE1[mode].savingPercent![c])).toBeLessThan(0.15);
      }
    }
  });

  it('Table 2 is consistent: added = resume and task - task', () => {
    for (const row of Object.values(STUDY_TABLE2)) {
      for (const c of ['repetitive', 'random'] as const) expect(row.resumeAndTaskMs[c] - row.taskMs[c]).toBeCloseTo(row.addedMs[c], 1);
    }
  });

  it('a lazy offload is compared with the study offload row; goals name modes the bench has rows for', () => {
    expect(studyRowOf('offload-lazy')).toBe('offload');
    expect(studyRowOf('idle-release')).toBe('idle-release');
    for (const g of GOALS) for (const m of g.modes) expect(STUDY_TABLE1[studyRowOf(m)]).toBeDefined();
  });

  it('Table 3 as typed reproduces its saving columns, before and after the rewrite, against private', () => {
    for (const rows of Object.values(STUDY_TABLE3)) {
      for (const row of [rows['shared-snapshot'], rows.ksm, rows['daemon-pool']]) {
        expect(Math.abs(savingPercent(rows.private.perVmMiB, row.perVmMiB) - row.savingPercent!)).toBeLessThan(0.15);
        expect(Math.abs(savingPercent(rows.private.perVmAfterRewriteMiB, row.perVmAfterRewriteMiB) - row.savingAfterRewritePercent!)).toBeLessThan(0.15);
      }
    }
  });

  it("Table 3's KSM goal is the study's own figure for that row", () => {
    const ksm = TABLE3_GOALS.find((g) => g.scheme === 'ksm')!;
    expect(ksm.minSavingPercent).toBe(STUDY_TABLE3[ksm.workingSet].ksm.savingPercent);
  });
});
