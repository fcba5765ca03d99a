// SPDX-License-Identifier: GPL-2.0
/* Reference counters and their debugfs view. */
#include <linux/atomic.h>
#include <linux/debugfs.h>
#include <linux/seq_file.h>

#include "refs.h"

static const char *const bunshin_ref_names[BUNSHIN_NR_REFS] = {
	[BUNSHIN_REF_TASK] = "task",
	[BUNSHIN_REF_MM] = "mm",
	[BUNSHIN_REF_PFNS] = "pfns",
};

static atomic64_t bunshin_gets[BUNSHIN_NR_REFS];
static atomic64_t bunshin_puts[BUNSHIN_NR_REFS];
static struct dentry *bunshin_debugfs;

void bunshin_ref_get(enum bunshin_ref ref)
{
	atomic64_inc(&bunshin_gets[ref]);
}

void bunshin_ref_put(enum bunshin_ref ref)
{
	atomic64_inc(&bunshin_puts[ref]);
}

/* One line per kind: "<name> <gets> <puts>". */
static int refs_show(struct seq_file *m, void *unused)
{
	int i;

	for (i = 0; i < BUNSHIN_NR_REFS; i++)
		seq_printf(m, "%s %lld %lld\n", bunshin_ref_names[i],
			   (long long)atomic64_read(&bunshin_gets[i]),
			   (long long)atomic64_read(&bunshin_puts[i]));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(refs);

/* debugfs is a diagnostic: the module works without it, so errors from it
 * are ignored as debugfs' own API asks. */
void bunshin_refs_init(void)
{
	bunshin_debugfs = debugfs_create_dir("bunshin", NULL);
	debugfs_create_file("refs", 0400, bunshin_debugfs, NULL, &refs_fops);
}

void bunshin_refs_exit(void)
{
	debugfs_remove_recursive(bunshin_debugfs);
}
