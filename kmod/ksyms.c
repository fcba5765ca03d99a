// SPDX-License-Identifier: GPL-2.0
/* Resolve the unexported kernel symbols listed in struct bunshin_ksyms. */
#define pr_fmt(fmt) "bunshin: ksyms: " fmt

#include <linux/kprobes.h>
#include <linux/kernel.h>

#include "ksyms.h"

struct bunshin_ksyms bunshin_ks;

static const struct {
	const char *name;
	void **slot;
} bunshin_ksym_table[] = {
	{ "walk_page_range", (void **)&bunshin_ks.walk_page_range },
	{ "mm_access", (void **)&bunshin_ks.mm_access },
	{ "__pmd_trans_huge_lock", (void **)&bunshin_ks.__pmd_trans_huge_lock },
	{ "huge_zero_pfn", (void **)&bunshin_ks.huge_zero_pfn },
	{ "max_pfn", (void **)&bunshin_ks.max_pfn },
	{ "ptrace_may_access", (void **)&bunshin_ks.ptrace_may_access },
	{ "tasklist_lock", (void **)&bunshin_ks.tasklist_lock },
	{ "copy_process", (void **)&bunshin_ks.copy_process },
	{ "wake_up_new_task", (void **)&bunshin_ks.wake_up_new_task },
	{ "create_new_namespaces", (void **)&bunshin_ks.create_new_namespaces },
	{ "free_nsproxy", (void **)&bunshin_ks.free_nsproxy },
	{ "copy_fs_struct", (void **)&bunshin_ks.copy_fs_struct },
	{ "free_fs_struct", (void **)&bunshin_ks.free_fs_struct },
	{ "task_work_cancel", (void **)&bunshin_ks.task_work_cancel },
	{ "wake_up_state", (void **)&bunshin_ks.wake_up_state },
	{ "signal_wake_up_state", (void **)&bunshin_ks.signal_wake_up_state },
#ifdef CONFIG_LRU_GEN
	{ "lru_gen_add_mm", (void **)&bunshin_ks.lru_gen_add_mm },
#endif
	{ "sys_call_table", (void **)&bunshin_ks.sys_call_table },
	{ "change_pid", (void **)&bunshin_ks.change_pid },
};

/* kallsyms_lookup_name() itself is unexported since 5.7; a kprobe placed on
 * it reports its address. */
static unsigned long (*bunshin_find_lookup(void))(const char *)
{
	struct kprobe kp = { .symbol_name = "kallsyms_lookup_name" };
	unsigned long (*lookup)(const char *);

	if (register_kprobe(&kp) < 0)
		return NULL;
	lookup = (unsigned long (*)(const char *))kp.addr;
	unregister_kprobe(&kp);
	return lookup;
}

int bunshin_ksyms_init(void)
{
	unsigned long (*lookup)(const char *) = bunshin_find_lookup();
	size_t i;

	if (!lookup) {
		pr_err("cannot locate kallsyms_lookup_name (CONFIG_KPROBES?)\n");
		return -ENOENT;
	}
	for (i = 0; i < ARRAY_SIZE(bunshin_ksym_table); i++) {
		unsigned long addr = lookup(bunshin_ksym_table[i].name);

		if (!addr) {
			pr_err("symbol %s not found\n", bunshin_ksym_table[i].name);
			return -ENOENT;
		}
		*bunshin_ksym_table[i].slot = (void *)addr;
	}
	return 0;
}
